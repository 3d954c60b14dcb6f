#!/usr/bin/env bash
# Session 18, device call 4: call 3's A/B again, twice, the variants' order swapped, 9 rounds, no profile.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
N=argmax+attn256+targmax+sk+fa+pdl+gu+ta
timeout 120 python3 benchmarks/generate_ab.py --rounds 9 --budget 8192 --attn-launch 4,3 --variants $N+tma,$N --json $OUT/call4_ab1.json > $OUT/call4_ab1.txt 2>&1
timeout 120 python3 benchmarks/generate_ab.py --rounds 9 --budget 8192 --attn-launch 4,3 --variants $N,$N+tma --json $OUT/call4_ab2.json > $OUT/call4_ab2.txt 2>&1
grep "^|" $OUT/call4_ab*.txt | cut -c1-260
