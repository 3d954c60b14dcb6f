#!/usr/bin/env bash
# Session 38 call 2b: call 2's failed tests after the fixes (the reference's scale division, aligned cuBLASLt
# operands, the W8A8 logit tolerance and BF16-first reference rows, the test's overlapped-step count). Carry build/whl.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 280 python3 -m pytest -q -s -p no:cacheprovider -rfE --durations=5 tests/gpu/test_fp8_rows_cuda.py \
  tests/gpu/test_weight_quant_cuda.py -k "fp8_rows or w8a8 or (unfused and True) or (more_than_64 and fp8-True) or add_rmsnorm or scaled or quantize_rows or fits" > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.txt | head -20
grep -E "fp8-w8a8:|act True|act False" $OUT/tests.txt | head -20
