#!/usr/bin/env bash
# Session 37 call 5: the 8-bit tests on the final code (Q8_MAX_M = 64: steps above 64 rows on the dequantization
# kernel, in CUDA graphs too; the product test now checks both paths at every row count). Carry build/whl.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider --durations=5 -rfE tests/gpu/test_weight_quant_cuda.py \
  -k "above_the_decode_rows" > $OUT/q8_tests.txt 2>&1
echo "q8 tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/q8_tests.txt; grep -E "^FAILED|^ERROR|equal on" $OUT/q8_tests.txt | head -20
