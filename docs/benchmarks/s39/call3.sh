#!/usr/bin/env bash
# Session 39 call 3: the decoder's GPU tests with the row graphs (graph_prefill_tokens) on by default; the TTFT
# benchmark (graph rows against eager steps, same run).
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 150 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --json $OUT/ttft.json \
  --plot $OUT/ttft.png > $OUT/ttft.txt 2>&1
echo "ttft rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE -s --durations=8 tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -12 $OUT/ttft.txt; grep -E "^FAILED|^ERROR|passed|failed|row-graph prefill" $OUT/tests.txt | head -20
