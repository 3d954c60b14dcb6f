#!/usr/bin/env bash
# Session 38 call 2: the FP8 W8A8 form's GPU tests (new kernels, the engine against transformers with FP8 input rows,
# the weight-only tests pinned, one BF16 fused-path test: add_rmsnorm changed), then engine rows BF16 / fp8 (W8A8) /
# fp8 weight-only at the Llama-3-8B shape (random BF16 weights). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 230 python3 -m pytest -q -s -p no:cacheprovider -rfE --durations=5 tests/gpu/test_fp8_rows_cuda.py \
  tests/gpu/test_weight_quant_cuda.py "tests/gpu/test_decoder_cuda.py::test_bf16_trained_model_greedy_equals_transformers[auto-fused-True]" \
  -k "fp8_rows or w8a8 or unfused or more_than_64 or follows or checkpoint or add_rmsnorm or scaled or quantize_rows or fits or bf16_trained" > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 300 python3 benchmarks/generate.py --device cuda --shape llama-8b --budget 8192 --rounds 2 \
  --baseline none --quantization fp8 --quantization fp8-weight-only --json $OUT/gen_llama-8b.json > $OUT/gen_llama-8b.txt 2>&1
echo "generate llama-8b rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.txt | head -20
grep -E "fp8-w8a8:|act True|act False|checkpoint:|prompts equal|trained model" $OUT/tests.txt | head -20
grep -v "^\[{" $OUT/gen_llama-8b.txt | grep -E "^\||against|replayed|Error|error|Traceback" | head -20
