#!/usr/bin/env bash
# Session 36 call 1 (the device came late and scarce: one call for the most): the first GPU run of session 35's
# 8-bit weights (tests/gpu/test_weight_quant_cuda.py), the BF16 suites of the two decode kernels session 35 changed
# (split-K, gate/up), then the shape with FP8 and INT8 weight rows beside BF16 in one run (no baseline:
# the BF16 row is the reference; session 34's compiled transformers read 13,638 tok/s on an H100).
# Carry build/whl (compressed-tensors: the FP8-checkpoint tests write one).
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE --maxfail=8 \
  tests/gpu/test_weight_quant_cuda.py > $OUT/q8_tests.txt 2>&1
echo "q8 tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 140 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 3 \
  --baseline none --quantization fp8 --quantization int8 --json $OUT/generate_q8.json > $OUT/generate_q8.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 -m pytest -q -p no:cacheprovider --durations=5 -rfE tests/gpu/test_splitk_gemm_cuda.py \
  tests/gpu/test_gate_up_cuda.py > $OUT/bf16_tests.txt 2>&1
echo "bf16 tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/q8_tests.txt $OUT/bf16_tests.txt; grep -E "^FAILED|^ERROR" $OUT/q8_tests.txt $OUT/bf16_tests.txt | head -30
grep -v "^\[{" $OUT/generate_q8.txt | grep -E "^\||against|replayed|Error|error" | head -20
