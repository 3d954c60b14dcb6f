#!/usr/bin/env bash
# Session 35 (not run: no device machine was lent this session; the next session's first call): 8-bit weights' first run. The engine with quantization=fp8 and int8 against BF16 in the same run
# (the plans 8-bit weights inherit from BF16, untuned), then the 8-bit GPU tests (call3.sh: the suites of the kernels that
# changed, on BF16 weights). Carry build/whl (with
# compressed_tensors' wheel added: the FP8-checkpoint GPU test writes one).
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 180 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --baseline none --rounds 3 \
  --quantization fp8 --quantization int8 > $OUT/generate_q8.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 380 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE tests/gpu/test_weight_quant_cuda.py \
  > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^\||against|replayed" $OUT/generate_q8.txt | head -20; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR|Error" $OUT/gpu_tests.txt | head -20
