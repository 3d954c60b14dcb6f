#!/usr/bin/env bash
# Session 35, the next session's second call (not run: no device machine was lent this session): plans for the
# decode GEMMs on FP8 and INT8 weights against the BF16 plans in the same run (Qwen2-0.5B), and the M sweep that
# says up to how many rows the 8-bit kernels beat cuBLAS on the dequantized weight. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 330 python3 benchmarks/gpu_q8_tune.py --quick --json $OUT/fp8_tune_qwen.json > $OUT/fp8_tune_qwen.txt 2>&1
echo "tune qwen rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 220 python3 benchmarks/gpu_q8_tune.py --quick --kind int8 --json $OUT/int8_tune_qwen.json > $OUT/int8_tune_qwen.txt 2>&1
echo "tune int8 qwen rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^\||Q8_PLANS|SplitKPlan|GateUpPlan" $OUT/*_tune_*.txt | head -40
