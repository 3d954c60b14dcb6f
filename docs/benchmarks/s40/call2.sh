#!/usr/bin/env bash
# Session 40 call 2: the beside stream's priority (-1: above the launches', the new default; 0: theirs), joining
# requests' TTFT with the engine loop in a thread and in its own process (as `surge serve` runs it); the prompt
# steps' own time beside the launches; the GPU tests of the loop's paths again.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 150 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 8 32 \
  --rows 512 --beside 1 0 --beside-priority -1 0 --joins 48 --interval 20 --json $OUT/ttft.json --plot $OUT/ttft.png > $OUT/ttft.txt 2>&1
echo "ttft thread rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 8 32 \
  --rows 512 --beside 1 0 --joins 48 --interval 20 --engine process --json $OUT/ttft_process.json > $OUT/ttft_process.txt 2>&1
echo "ttft process rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py \
  -k "beside or multi_step or service_streams or row_graphs" > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|prefill beside" $OUT/tests.txt | head; tail -9 $OUT/ttft.txt
tail -7 $OUT/ttft_process.txt
