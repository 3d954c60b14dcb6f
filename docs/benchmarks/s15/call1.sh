# Session 15, device call 1 (nvidia-h200): session 14's review commit checked on the GPU (persistent/dataflow MLP
# kernels), the new TMA-streamed MLP kernel's tests, benchmarks/gpu_tma_stream.py (TMA weight streaming through
# shared memory across grid barriers), benchmarks/gpu_tma_mlp.py (the kernel against the three-kernel chain).
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_persistent_mlp_cuda.py tests/gpu/test_tma_mlp_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/gpu_tma_stream.py --json $OUT/tma_stream.json > $OUT/tma_stream.txt 2>&1; echo "tma_stream rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/gpu_tma_mlp.py --json $OUT/tma_mlp.json > $OUT/tma_mlp.txt 2>&1; echo "tma_mlp rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/tests.txt; grep -E "^FAILED|^E  " $OUT/tests.txt | head -30; tail -45 $OUT/tma_stream.txt; tail -20 $OUT/tma_mlp.txt
