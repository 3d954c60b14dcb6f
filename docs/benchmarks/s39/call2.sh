#!/usr/bin/env bash
# Session 39 call 2: W8A8's prefill host time (enqueue and torch.profiler's host ops per form); an ad-hoc probe of
# INT8 tensor-core GEMMs (torch._int_mm) against FP8 _scaled_mm and BF16 at decode rows, and host costs per call.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 200 python3 benchmarks/generate_prefill_host.py --device cuda --shape qwen2-0.5b --prompts 64 \
  --quantization none --quantization fp8 --quantization fp8-weight-only --host-ops 18 > $OUT/prefill_host.txt 2>&1
echo "prefill rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/gpu_int8_probe.py > $OUT/int8_probe.txt 2>&1
echo "probe rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "enqueue|wall" $OUT/prefill_host.txt; cat $OUT/int8_probe.txt | tail -30
