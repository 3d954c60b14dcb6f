#!/usr/bin/env bash
# Session 49, call 2: the whole of test_weight_quant_cuda.py (call 1, the whole GPU directory, ran out of its
# limit inside it, before the FP8 W8A8 test that failed in session 48's suite run).
set +e
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout ${LIMIT:-540} python3 -m pytest -v -p no:cacheprovider -rfE --tb=short --durations=5 tests/gpu/test_weight_quant_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "FAILED|ERROR" $OUT/gpu_tests.txt | cut -c1-300 | head -20; grep -c PASSED $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt | cut -c1-300
