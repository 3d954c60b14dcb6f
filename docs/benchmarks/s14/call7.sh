# Session 14, device call 7 (nvidia-h200): the review's refactor of the persistent / dataflow kernels (shared
# prefetch and inverse-RMS helpers, dead helpers removed), their GPU tests only.
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
date -u > $OUT/env.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_persistent_mlp_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$?" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/tests.txt; grep -E "FAILED|Error" $OUT/tests.txt | head
