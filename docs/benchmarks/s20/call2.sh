#!/bin/bash
# Session 20, device call 2: the Llama-1B decode step with call 1's split-K plans and gate/up plan against
# cuBLAS (the engine before session 20 on this shape), with and without PDL, interleaved (generate_ab).
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl
export PYTHONPATH=/tmp/site:src
B=argmax+attn256+targmax+fa+ta
timeout 560 python3 benchmarks/generate_ab.py --shape llama-1b --rounds 7 --profile --attn-launch 4,3 \
    --variants $B+pdl+tma,$B+pdl+sk+gu,$B+tma,$B+sk+gu \
    --splitk-plans docs/benchmarks/s20/call1/sk_llama.json --gate-up-plan 32,128,4,3,false,true \
    --json $OUT/ab_llama.json > $OUT/ab_llama.txt 2>&1; echo "ab rc=$?"
grep -v "^variant .*loaded\|Warning\|warn" $OUT/ab_llama.txt | tail -30
