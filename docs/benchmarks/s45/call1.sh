#!/usr/bin/env bash
# Session 45, call 1: (a) session 44's unrun graph-capture test (old global mode patched back: must fail; then
# the new code with the decoder / embedder / tensor files); (b) the decoder embedder made batch invariant on the
# GPU (its test file) and its cost (benchmarks/decoder_embed.py at Qwen3-Embedding-0.6B's shape); (c) the
# generation step loop's quarantine change: the containment and graph files; (d) the split of torch_gpu /
# decoder runner into modules (pure moves; their CUDA paths run only here): the torch engine's GPU files.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpucarry/ref_fp32.npy
NEW=tests/gpu/test_decoder_cuda.py::test_decoder_graphs_are_captured_while_another_engine_serves
cp src/surge/engines/graph_capture.py /tmp/gc.py && sed -i 's/capture_error_mode="thread_local"/capture_error_mode="global"/' src/surge/engines/graph_capture.py
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=line $NEW > $OUT/old_mode.txt 2>&1; echo "old mode rc=$?" >> $OUT/env.txt
cp /tmp/gc.py src/surge/engines/graph_capture.py
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 $NEW tests/gpu/test_decoder_embedder_cuda.py tests/gpu/test_decoder_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 tests/gpu/test_torch_engine_cuda.py tests/gpu/test_batch_invariance_cuda.py tests/gpu/test_task_heads_cuda.py tests/gpu/test_pipeline_cuda.py tests/gpu/test_tensor_torch_cuda.py > $OUT/gpu_tests_encoder.txt 2>&1
echo "encoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 80 python3 benchmarks/decoder_embed.py --device cuda --shape qwen3-0.6b --rounds 5 --json $OUT/decoder_embed.json > $OUT/decoder_embed.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/old_mode.txt | cut -c1-300; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt $OUT/gpu_tests_encoder.txt | cut -c1-300 | head -30; tail -8 $OUT/decoder_embed.txt
