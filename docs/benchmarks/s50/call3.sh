#!/usr/bin/env bash
# Session 50, call 3: the floor probe again (call 1's best plan, deeper activation rings) with the barriers alone.
set +e
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=src:.
t=$(date +%s); timeout 200 python3 benchmarks/gpu_megakernel_floor.py --plans 64x24,64x18x6,128x8x4 --json $OUT/floor.json > $OUT/floor.txt 2>&1
echo "floor rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -20 $OUT/floor.txt | cut -c1-300
