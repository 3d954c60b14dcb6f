#!/usr/bin/env bash
# Session 36 call 2: the benchmark (Qwen2-0.5B shape, 64 streams, 128 + 128, transformers static cache with
# and without torch.compile in the same run) with surge's FP8 and INT8 weight rows beside its BF16 row, then the
# 8-bit plans of the decode GEMMs against the BF16 plans (benchmarks/gpu_q8_tune.py --quick, FP8). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 200 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile \
  --quantization fp8 --quantization int8 --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 280 python3 benchmarks/gpu_q8_tune.py --quick --json $OUT/fp8_tune_qwen.json > $OUT/fp8_tune_qwen.txt 2>&1
echo "tune fp8 qwen rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -v "^\[{" $OUT/generate.txt | tail -12; grep -E "^\||Q8_PLANS|SplitKPlan|GateUpPlan" $OUT/fp8_tune_qwen.txt | head -40
