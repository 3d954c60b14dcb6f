#!/usr/bin/env bash
# Session 34 call 8: the engine-process stream test after it learned to tell an FP32 near-tie from a wrong
# token (call 5's flake). Carry build/whl.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE "tests/gpu/test_decoder_cuda.py::test_service_streams_multi_step_launches" > $OUT/gpu_tests.txt 2>&1
echo "rc=$?" >> $OUT/gpu_tests.txt; tail -4 $OUT/gpu_tests.txt
