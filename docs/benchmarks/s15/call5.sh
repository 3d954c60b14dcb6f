# Session 15, device call 5 (nvidia-h200): the final code's persistent-kernel GPU tests (session 14's and tma_mlp's).
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tma_mlp_cuda.py tests/gpu/test_persistent_mlp_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$?"
tail -3 $OUT/tests.txt; grep -E "^FAILED|^E  " $OUT/tests.txt | head -20
