#!/usr/bin/env bash
# Session 39 call 5: the 8-bit GPU tests with the row graphs on by default (and the staging change); the issue's
# benchmark on this session's code.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_weight_quant_cuda.py \
  tests/gpu/test_decoder_cuda.py::test_short_prompts_prefill_through_the_row_graphs > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 220 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 \
  --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.txt | head; tail -12 $OUT/generate.txt
