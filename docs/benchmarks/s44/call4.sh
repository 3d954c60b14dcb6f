#!/usr/bin/env bash
# Session 44, call 4: every CUDA graph captured in thread-local mode under one process lock (engines/graph_capture.py).
# The new test (a decoder captured while an encoder serves on another thread) first on the old global mode (this
# machine's copy patched back: it must fail), then on the new code with the decoder, decoder-embedder and tensor files.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpucarry/ref_fp32.npy
NEW=tests/gpu/test_decoder_cuda.py::test_decoder_graphs_are_captured_while_another_engine_serves
cp src/surge/engines/graph_capture.py /tmp/gc.py && sed -i 's/capture_error_mode="thread_local"/capture_error_mode="global"/' src/surge/engines/graph_capture.py
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=line $NEW > $OUT/old_mode.txt 2>&1; echo "old mode rc=$?" >> $OUT/env.txt
cp /tmp/gc.py src/surge/engines/graph_capture.py
t=$(date +%s); timeout 320 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 $NEW tests/gpu/test_decoder_cuda.py tests/gpu/test_decoder_embedder_cuda.py tests/gpu/test_tensor_torch_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/old_mode.txt | cut -c1-300; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | head -20
