# Session 15, device call 1 (nvidia-h200): session 14's review commit checked on the GPU (persistent/dataflow MLP
# kernels, 10 tests), then benchmarks/gpu_tma_stream.py (TMA weight streaming through shared memory across grid
# barriers), then session 14's persistent-MLP benchmark again for the same-run chain baseline.
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_persistent_mlp_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/gpu_tma_stream.py --json $OUT/tma_stream.json > $OUT/tma_stream.txt 2>&1; echo "tma_stream rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/gpu_persistent_mlp.py --json $OUT/persistent_mlp.json > $OUT/persistent_mlp.txt 2>&1; echo "persistent_mlp rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/tests.txt; grep -E "FAILED|Error" $OUT/tests.txt | head; cat $OUT/tma_stream.txt | tail -70; tail -25 $OUT/persistent_mlp.txt
