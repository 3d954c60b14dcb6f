#!/usr/bin/env bash
# Session 34 call 7: the review's one tile product (kernels/tile_mma.py, imported by the split-K, gate/up and LoRA
# kernels): their GPU test files on the final code. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_splitk_gemm_cuda.py tests/gpu/test_tma_gemm_cuda.py \
  tests/gpu/test_gate_up_cuda.py tests/gpu/test_lora_delta_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head
