#!/usr/bin/env bash
# Session 38 call 2c: the W8A8 engine test (its last check reworked), then engine rows BF16 / fp8 (W8A8) / fp8
# weight-only at the Llama-1B and Qwen2-0.5B shapes. Carry build/whl.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 100 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_weight_quant_cuda.py -k "w8a8_engine" > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for shape in llama-1b qwen2-0.5b; do
t=$(date +%s); timeout 100 python3 benchmarks/generate.py --device cuda --shape $shape --budget 8192 --rounds 2 \
  --baseline none --quantization fp8 --quantization fp8-weight-only --json $OUT/gen_$shape.json > $OUT/gen_$shape.txt 2>&1
echo "generate $shape rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|fp8-w8a8:" $OUT/tests.txt | head
for f in $OUT/gen_*.txt; do grep -v "^\[{" $f | grep -E "^\||against|replayed|Error|error" | head -12; done
