#!/usr/bin/env bash
# Session 26, device call 2: generation over HTTP with the server's own TTFT scraped from /metrics each round:
# 8 and 1 load-generator processes, and the server with overlap_depth=1 (arrivals wait for fewer launches).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
B="benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --rounds 5"
t=$(date +%s); timeout 200 python3 $B --json $OUT/c8.json > $OUT/c8.txt 2>&1; echo "c8 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 $B --clients 1 --skip-inproc --json $OUT/c1.json > $OUT/c1.txt 2>&1; echo "c1 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 $B --skip-inproc --server-arg=--generation=overlap_depth=1 --json $OUT/d1.json > $OUT/d1.txt 2>&1; echo "d1 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; for f in c8 c1 d1; do echo "== $f"; grep -E "round|^\||http /" $OUT/$f.txt; done
