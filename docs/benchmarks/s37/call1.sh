#!/usr/bin/env bash
# Session 37 call 1: the 8-bit product above the decode step's 64 rows (the split-K kernel's M tiles up to
# splitk_gemm.Q8_MAX_M, cuBLAS on the weight dequantized by the new kernels/dequant.py above): its GPU tests, the
# table that sets Q8_MAX_M (benchmarks/gpu_q8_rows.py, FP8 and INT8), then the BF16 suites of the kernels session 35
# changed (not run since). Carry build/whl (compressed-tensors: the checkpoint tests write one).
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 100 python3 benchmarks/gpu_q8_rows.py --json $OUT/q8_rows_fp8.json > $OUT/q8_rows.txt 2>&1
echo "q8 rows fp8 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 230 python3 -m pytest -q -p no:cacheprovider --durations=8 -rfE --maxfail=10 \
  tests/gpu/test_weight_quant_cuda.py > $OUT/q8_tests.txt 2>&1
echo "q8 tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 60 python3 benchmarks/gpu_q8_rows.py --kind int8 --rows 96 128 192 256 >> $OUT/q8_rows.txt 2>&1
echo "q8 rows int8 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 170 python3 -m pytest -q -p no:cacheprovider --durations=5 -rfE tests/gpu/test_splitk_gemm_cuda.py \
  tests/gpu/test_gate_up_cuda.py tests/gpu/test_tma_gemm_cuda.py > $OUT/bf16_tests.txt 2>&1
echo "bf16 tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/q8_tests.txt $OUT/bf16_tests.txt; grep -E "^FAILED|^ERROR" $OUT/q8_tests.txt $OUT/bf16_tests.txt | head -30
grep -E "^\||beat|dequantization alone|Error|error" $OUT/q8_rows.txt | head -40
