# Session 14, device call 1-3 (nvidia-h200): the persistent MLP kernel (engines/kernels/persistent_mlp.py),
# its GPU tests, then benchmarks/gpu_persistent_mlp.py against the three-kernel chain.
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_persistent_mlp_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 330 python3 benchmarks/gpu_persistent_mlp.py --json $OUT/persistent_mlp.json > $OUT/bench.txt 2>&1; echo "bench rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -5 $OUT/tests.txt; grep -E "FAILED|Error|assert" $OUT/tests.txt | head -20; tail -30 $OUT/bench.txt
