#!/usr/bin/env bash
# Session 32 call 5: the LoRA shrink begun on a side stream beside the module's GEMM: its tests, the engine's
# LoRA tests (graphs = eager = peft), and what adapter rows cost now against the torch form. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 150 python3 -m pytest -q tests/gpu/test_lora_delta_cuda.py tests/gpu/test_decoder_cuda.py \
  -k "lora or shrink" -p no:cacheprovider -rfE > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b --streams 64 --prompt 128 \
  --output 128 --rounds 3 --json $OUT/generate_lora.json > $OUT/generate_lora.txt 2>&1
echo "generate_lora rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -n "^E \|FAILED" $OUT/gpu_tests.txt | head -10; grep -v "Loading\|Writing" $OUT/generate_lora.txt | tail -7
