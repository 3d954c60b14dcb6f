#!/usr/bin/env bash
# Session 36 call 1b: call1.sh cut to the ~6 device minutes left after the failed starts: the 8-bit GPU tests, then
# the shape with an FP8 weight row beside BF16 (no baseline). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 170 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE --maxfail=8 \
  tests/gpu/test_weight_quant_cuda.py > $OUT/q8_tests.txt 2>&1
echo "q8 tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 3 \
  --baseline none --quantization fp8 --json $OUT/generate_fp8.json > $OUT/generate_fp8.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/q8_tests.txt; grep -E "^FAILED|^ERROR" $OUT/q8_tests.txt | head -30
grep -v "^\[{" $OUT/generate_fp8.txt | grep -E "^\||against|replayed|Error|error" | head -20
