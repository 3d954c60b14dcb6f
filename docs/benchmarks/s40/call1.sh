#!/usr/bin/env bash
# Session 40 call 1: prompts prefilled beside the decode launches in flight (prefill_beside), on the GPU: the
# decoder's GPU tests (the new one included); joining requests' TTFT with it on and off (and eager steps); the
# issue's benchmark on the new default; questions after a 2,000-token cached system prompt (s39/next_call.sh).
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 190 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 8 32 256 \
  --rows 512 0 --beside 1 0 --json $OUT/ttft.json --plot $OUT/ttft.png > $OUT/ttft.txt 2>&1
echo "ttft rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 \
  --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 95 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 8 32 128 \
  --prefix 2000 --rows 512 0 --beside 1 --joins 8 --json $OUT/ttft_prefix2000.json > $OUT/ttft_prefix2000.txt 2>&1
echo "ttft prefix 2000 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|prefill beside" $OUT/tests.txt | head; tail -7 $OUT/ttft.txt
tail -12 $OUT/generate.txt; tail -7 $OUT/ttft_prefix2000.txt
