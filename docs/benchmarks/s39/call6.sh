#!/usr/bin/env bash
# Session 39 call 6: the final row-graph code (steps of up to 512 tokens in replays of <= 256 rows, the staging sets'
# events): its GPU test, and the TTFT benchmark with prompts past one replay.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE -s \
  tests/gpu/test_decoder_cuda.py::test_short_prompts_prefill_through_the_row_graphs > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 130 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 8 32 256 384 512 1024 \
  --rows 512 0 --json $OUT/ttft.json --plot $OUT/ttft.png > $OUT/ttft.txt 2>&1
echo "ttft rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|row-graph prefill" $OUT/tests.txt | head; tail -10 $OUT/ttft.txt
