#!/usr/bin/env bash
# Session 50, call 5: the floor probe and the benchmark on one machine (asked for as an H200; the card that
# came is in env.txt).
set +e
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_stream_floor_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/gpu_megakernel_floor.py --plans 64x24,128x12,128x8x4 --json $OUT/floor.json > $OUT/floor.txt 2>&1
echo "floor rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 300 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/tests.txt; tail -18 $OUT/floor.txt | cut -c1-300; grep -E "^\| |surge:" $OUT/generate.txt | cut -c1-300
