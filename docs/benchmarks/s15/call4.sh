# Session 15, device call 4 (nvidia-h200): tma_mlp with the gate and up MMAs of a chunk in flight together (call 3: 35.3 us; call 2: 54.6; call 1:
# one at a time, 46 us a layer), its GPU tests and session 14s (their reference now shared), the benchmark with the phase ablation.
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tma_mlp_cuda.py tests/gpu/test_persistent_mlp_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/gpu_tma_mlp.py --json $OUT/tma_mlp.json > $OUT/tma_mlp.txt 2>&1; echo "tma_mlp rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/tests.txt; grep -E "^FAILED|^E  " $OUT/tests.txt | head -30; tail -24 $OUT/tma_mlp.txt
