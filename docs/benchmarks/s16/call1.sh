# Session 16, device call 1 (nvidia-h200): session 15's review commit checked on the GPU (both persistent MLP
# kernels' tests: 18 passed in the first run of this script), then where a generation round's wall time goes, step by step (benchmarks/generate_timeline.py).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_persistent_mlp_cuda.py tests/gpu/test_tma_mlp_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 240 python3 benchmarks/generate_timeline.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 3 --json $OUT/timeline.json > $OUT/timeline.txt 2>&1; echo "timeline rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/tests.txt; grep -E "^FAILED|^E  " $OUT/tests.txt | head -30; grep -v "Writing\|Loading" $OUT/timeline.txt | tail -80
