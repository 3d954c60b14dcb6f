#!/usr/bin/env bash
# Session 24, device call 1: what each kind of kernel costs inside the decode step's PDL chain
# (benchmarks/gpu_step_ablation.py: the bucket-64 decode graph captured again with that kind left out),
# at both of the issue's shapes, on the engine's defaults (session 21's code; no GPU code changed since).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
for s in qwen2-0.5b llama-1b; do
  t=$(date +%s); timeout 240 python3 benchmarks/gpu_step_ablation.py --shape $s --repeats 7 --json $OUT/ablation_$s.json > $OUT/ablation_$s.txt 2>&1; echo "ablation $s rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt
for s in qwen2-0.5b llama-1b; do grep -E "^\||^qwen|^llama|Error|error" $OUT/ablation_$s.txt | tail -14; done
