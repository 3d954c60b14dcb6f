# Session 11, device call 1 (nvidia-h200): the whole GPU test directory on the code session 10 ended with
# (the decode-attention launch shape (4, 3) was only checked by its sweep then), (session 11 call 1a: the same benchmark run once gave surge 55,857 tok/s median vs compiled transformers 15,717).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
export SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpuwork/ref_fp32.npy
t=$(date +%s); timeout 480 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/tests_gpu.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "passed|failed|FAILED|ERROR" $OUT/tests_gpu.txt | tail -15
