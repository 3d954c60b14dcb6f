#!/usr/bin/env bash
# Session 34 call 3: what the LoRA deltas cost each module's decode GEMM, joined or as two kernels
# (benchmarks/gpu_lora_join.py, 2 and 4 slots of rank 16), and generate_lora with 4 adapters (qkv's 192 stacked
# columns pass JOIN_MAX_R: its deltas take the two kernels, the other modules join). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 200 python3 benchmarks/gpu_lora_join.py --slots 2 --slots 4 --json $OUT/lora_join.json > $OUT/lora_join.txt 2>&1
echo "lora_join rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 240 python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b --rounds 3 --loras 4 \
  --json $OUT/generate_lora4.json > $OUT/generate_lora4.txt 2>&1
echo "generate_lora4 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; cat $OUT/lora_join.txt | tail -20; tail -9 $OUT/generate_lora4.txt
