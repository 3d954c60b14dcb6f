#!/usr/bin/env bash
# Session 50, call 2 (same warm H100 as call 1, whose generate.py lacked the carried wheels): the benchmark
# on this card, beside call 1's floor probe.
set +e
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 330 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -16 $OUT/generate.txt | cut -c1-300
