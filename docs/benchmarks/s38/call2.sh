#!/usr/bin/env bash
# Session 38 call 2: the FP8 W8A8 form's GPU tests (new kernels, the engine against transformers with FP8 input rows,
# the weight-only tests pinned), the fused BF16 path's tests (add_rmsnorm changed), then engine rows BF16 / fp8 (W8A8)
# / fp8 weight-only at the Qwen2-0.5B and Llama-1B shapes. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 250 python3 -m pytest -q -s -p no:cacheprovider -rfE --durations=5 tests/gpu/test_fp8_rows_cuda.py \
  tests/gpu/test_weight_quant_cuda.py -k "fp8_rows or w8a8 or unfused or more_than_64 or follows or checkpoint or add_rmsnorm or scaled or quantize_rows or fits" > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py \
  -k "bf16_trained_model" > $OUT/decoder_tests.txt 2>&1
echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for shape in qwen2-0.5b llama-1b; do
t=$(date +%s); timeout 110 python3 benchmarks/generate.py --device cuda --shape $shape --budget 8192 --rounds 2 \
  --baseline none --quantization fp8 --quantization fp8-weight-only --json $OUT/gen_$shape.json > $OUT/gen_$shape.txt 2>&1
echo "generate $shape rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; tail -3 $OUT/tests.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.txt | head; tail -2 $OUT/decoder_tests.txt
grep -E "fp8-w8a8:|act True|act False|checkpoint:|prompts equal" $OUT/tests.txt | head -20
for f in $OUT/gen_*.txt; do grep -v "^\[{" $f | grep -E "^\||against|replayed|Error|error" | head -12; done
