#!/usr/bin/env bash
# Session 29, device call 3: what structured outputs cost on the GPU (benchmarks/guided.py): 64 streams of the
# Qwen2-0.5B shape, none / one / all held to a JSON schema, interleaved rounds.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 420 python3 benchmarks/guided.py --device cuda --shape qwen2-0.5b --rounds 3 --json $OUT/guided.json > $OUT/guided.txt 2>&1; echo "guided rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -12 $OUT/guided.txt
