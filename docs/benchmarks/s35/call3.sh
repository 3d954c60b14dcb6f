#!/usr/bin/env bash
# Session 35, the next session's third call (not run: no device machine was lent this session): the GPU suites of
# the kernels and the engine code this session changed, on BF16 weights (the split-K and gate/up kernels took a
# scale argument and a byte size in their L2 prefetch; tile_mma converts its weight tile to the activations' dtype;
# the decoder's loader and model route 8-bit weights). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 570 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE tests/gpu/test_splitk_gemm_cuda.py \
  tests/gpu/test_gate_up_cuda.py tests/gpu/test_lora_delta_cuda.py tests/gpu/test_tma_gemm_cuda.py \
  tests/gpu/test_decoder_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head -20
