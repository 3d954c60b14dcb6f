#!/usr/bin/env bash
# Session 50, call 4: call 3 with the probe's own per-phase round trips off the barrier's path (bounds asked for before it, counts stored, not added atomically); its tests first.
set +e
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=src:.
t=$(date +%s); timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_stream_floor_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/gpu_megakernel_floor.py --plans 64x24,64x18x6,128x12,128x8x4 --json $OUT/floor.json > $OUT/floor.txt 2>&1
echo "floor rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/tests.txt; tail -20 $OUT/floor.txt | cut -c1-300
