#!/usr/bin/env bash
# Session 18, device call 6: call 5's kernel tests after the fix (the MMA helper with one return).
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_tma_gemm_cuda.py tests/gpu/test_gate_up_cuda.py tests/gpu/test_splitk_gemm_cuda.py > $OUT/call6_tests.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/call6_tests.txt; grep -E "^FAILED|^E  " $OUT/call6_tests.txt | head -10
