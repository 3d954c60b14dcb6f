#!/usr/bin/env bash
# Session 32 call 1: the one-kernel LoRA delta (kernels/lora_delta.py): its tests, the LoRA engine tests (now on
# it in BF16), what adapter rows cost with it against the torch form, and the benchmark. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 200 python3 -m pytest -q tests/gpu/test_lora_delta_cuda.py tests/gpu/test_decoder_cuda.py -p no:cacheprovider \
  -k "lora or multi_step_launches" > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b --streams 64 --prompt 128 \
  --output 128 --rounds 3 --json $OUT/generate_lora.json > $OUT/generate_lora.txt 2>&1
echo "generate_lora rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile \
  --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/gpu_tests.txt; grep -n "^E \|FAILED" $OUT/gpu_tests.txt | head -20
grep -v "Loading\|Writing" $OUT/generate_lora.txt | tail -8; tail -12 $OUT/generate.txt
