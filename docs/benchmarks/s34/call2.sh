#!/usr/bin/env bash
# Session 34 call 2: the LoRA join with x A^T summed in the GEMMs' own K loop (call 1's form walked K a second
# time after the loop and was slower than the two delta kernels). The GPU tests, then generate_lora at the
# issue's shape (joined / two delta kernels / torch form, rounds interleaved). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 240 python3 -m pytest -q tests/gpu/test_lora_delta_cuda.py "tests/gpu/test_decoder_cuda.py::test_lora_adapters_on_the_gpu" \
  -p no:cacheprovider --durations=10 -rfE > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 240 python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b --rounds 3 \
  --json $OUT/generate_lora.json > $OUT/generate_lora.txt 2>&1
echo "generate_lora rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/gpu_tests.txt; grep -n "^E  \|FAILED\|Error" $OUT/gpu_tests.txt | head -30
tail -9 $OUT/generate_lora.txt
