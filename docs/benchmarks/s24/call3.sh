#!/usr/bin/env bash
# Session 24, device call 3: benchmarks/gpu_step_ablation.py again after its replay timer became
# generate.replay_us (bb60051), Qwen2-0.5B only: the refactored script runs and reads as call 1 did.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 240 python3 benchmarks/gpu_step_ablation.py --shape qwen2-0.5b --repeats 7 --json $OUT/ablation_qwen2-0.5b.json > $OUT/ablation_qwen2-0.5b.txt 2>&1; echo "ablation rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^\||^qwen|Error|error" $OUT/ablation_qwen2-0.5b.txt | tail -14
