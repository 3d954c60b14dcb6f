#!/usr/bin/env bash
# Session 50, call 1: the decode-step floor probe (engines/kernels/stream_floor.py): its GPU tests, then
# benchmarks/gpu_megakernel_floor.py, then the engine's own step on the same card (generate.py, no baseline).
set +e
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 150 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short tests/gpu/test_stream_floor_cuda.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/gpu_megakernel_floor.py --json $OUT/floor.json > $OUT/floor.txt 2>&1
echo "floor rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout ${GEN_LIMIT:-150} python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 2 --baseline none --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -15 $OUT/tests.txt | cut -c1-250; cat $OUT/floor.txt | tail -30 | cut -c1-300; tail -12 $OUT/generate.txt | cut -c1-300
