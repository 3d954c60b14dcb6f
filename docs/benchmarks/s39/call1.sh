#!/usr/bin/env bash
# Session 39 call 1: the FP8 probe's reworked GPU test; where W8A8's prefill time goes (BF16 / FP8 W8A8 / FP8
# weight-only, one prefill step of 64 x 128 tokens, the top kernels of each), Qwen2-0.5B and Llama-1B shapes.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_fp8_rows_cuda.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for s in qwen2-0.5b llama-1b; do
  t=$(date +%s); timeout 200 python3 benchmarks/generate_prefill_host.py --device cuda --shape $s --prompts 64 \
    --quantization none --quantization fp8 --quantization fp8-weight-only --kernels 14 --json $OUT/prefill_$s.json \
    > $OUT/prefill_$s.txt 2>&1
  echo "prefill $s rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.txt | head
grep -E "^\[|^ +[0-9.]+ ms" $OUT/prefill_*.txt
