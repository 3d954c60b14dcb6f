#!/usr/bin/env bash
# Session 34 call 4: A's LoRA tiles read by TMA in the TMA GEMM kernels (call 3: the down GEMM's join cost +6 us
# of its 5 with pointer loads): gpu_lora_join with both forms, the LoRA GPU tests, generate_lora (2 adapters).
# Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 200 python3 benchmarks/gpu_lora_join.py --slots 2 --slots 4 --a-loads both --json $OUT/lora_join.json > $OUT/lora_join.txt 2>&1
echo "lora_join rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 -m pytest -q tests/gpu/test_lora_delta_cuda.py "tests/gpu/test_decoder_cuda.py::test_lora_adapters_on_the_gpu" \
  -p no:cacheprovider --durations=5 -rfE > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b --rounds 3 \
  --json $OUT/generate_lora.json > $OUT/generate_lora.txt 2>&1
echo "generate_lora rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -16 $OUT/lora_join.txt; tail -3 $OUT/gpu_tests.txt; grep -n "^E  \|FAILED" $OUT/gpu_tests.txt | head -20
tail -9 $OUT/generate_lora.txt
