#!/usr/bin/env bash
# Session 33 call 9: draft-model speculation on the GPU (its test), with the other speculation tests. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 150 python3 -m pytest -q tests/gpu/test_decoder_cuda.py -k "speculative or draft_model" -p no:cacheprovider \
  -rfE -s > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -n "^E \|FAILED\|speculation\|draft model" $OUT/gpu_tests.txt | head -20
