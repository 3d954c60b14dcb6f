#!/usr/bin/env bash
# Session 43, call 3 (run inline as the tool's command): call 1's four failures (the L2-prefetch tests) after the
# bundled-model bucket tests that ran before them in call 1, in one process.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
export PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpucarry/ref_fp32.npy
timeout 170 python3 -m pytest -q -p no:cacheprovider -x --tb=short tests/gpu/test_buckets_cuda.py tests/gpu/test_decoder_cuda.py -k "buckets or warmup_builds or service_under_load or l2_prefetch or bulk_prefetch" > $OUT/order.txt 2>&1
