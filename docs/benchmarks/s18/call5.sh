#!/usr/bin/env bash
# Session 18, device call 5: the GPU tests of the kernels after their shared parts became jit helpers
# (the TMA and pointer kernels of splitk_gemm.py and gate_up.py), and the engine against transformers.
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tma_gemm_cuda.py tests/gpu/test_splitk_gemm_cuda.py tests/gpu/test_gate_up_cuda.py tests/gpu/test_decoder_cuda.py > $OUT/call5_tests.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/call5_tests.txt; grep -E "^FAILED|^E  " $OUT/call5_tests.txt | head -20
