#!/usr/bin/env bash
# Session 36 call 1: the first GPU run of session 35's 8-bit weights (tests/gpu/test_weight_quant_cuda.py), then the
# GPU suites of the kernels session 35 changed, on BF16 weights (split-K, gate/up, LoRA, TMA GEMM, decoder).
# Carry build/whl (compressed-tensors: the FP8-checkpoint tests write one).
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 210 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE --maxfail=8 \
  tests/gpu/test_weight_quant_cuda.py > $OUT/q8_tests.txt 2>&1
echo "q8 tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 250 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE tests/gpu/test_splitk_gemm_cuda.py \
  tests/gpu/test_gate_up_cuda.py tests/gpu/test_lora_delta_cuda.py tests/gpu/test_tma_gemm_cuda.py \
  tests/gpu/test_decoder_cuda.py > $OUT/bf16_tests.txt 2>&1
echo "bf16 tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/q8_tests.txt $OUT/bf16_tests.txt; grep -E "^FAILED|^ERROR" $OUT/q8_tests.txt $OUT/bf16_tests.txt | head -30
