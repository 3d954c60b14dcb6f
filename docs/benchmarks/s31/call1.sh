#!/usr/bin/env bash
# Session 31 call 1: session 30's GPU paths (Qwen3 / Granite on the unfused layer, cached tokens across the engine
# process) and this session's LoRA adapters on the GPU (unfused and fused layer), then what LoRA slots cost on the
# issue's Qwen2-0.5B shape. Carry build/whl (peft and accelerate for the LoRA test's reference). ~6 min.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 200 python3 -m pytest -q tests/gpu/test_decoder_cuda.py -p no:cacheprovider \
  -k "lora or unfused or multi_step" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 130 python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b --streams 64 --prompt 128 \
  --output 128 --rounds 2 --json $OUT/generate_lora.json > $OUT/generate_lora.txt 2>&1
echo "generate_lora rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -8 $OUT/gpu_tests.txt; grep -v "Loading\|Writing" $OUT/generate_lora.txt | tail -8
