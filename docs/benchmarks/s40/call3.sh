#!/usr/bin/env bash
# Session 40 call 3: a beside step's first tokens returned at once (the loop no longer reads a launch back
# before handing them out); joining requests' TTFT, engine loop in a thread and in its own process; the decoder's
# GPU tests on this code.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 120 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 8 32 \
  --rows 512 --beside 1 0 --joins 48 --interval 20 --json $OUT/ttft.json --plot $OUT/ttft.png > $OUT/ttft.txt 2>&1
echo "ttft thread rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 8 32 \
  --rows 512 --beside 1 0 --joins 48 --interval 20 --engine process --json $OUT/ttft_process.json > $OUT/ttft_process.txt 2>&1
echo "ttft process rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 220 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|prefill beside" $OUT/tests.txt | head; tail -8 $OUT/ttft.txt
tail -6 $OUT/ttft_process.txt
