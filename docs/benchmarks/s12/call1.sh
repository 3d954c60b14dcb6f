# Session 12, device call 1-2 (nvidia-h200): weights asked into L2 from a side stream a phase ahead
# (kernels/l2_prefetch.py): its GPU tests, then the default engine against the default + pf, interleaved.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decoder_cuda.py -k "prefetch" > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
N=argmax+attn256+targmax+sk+fa+pdl+gu+ta
t=$(date +%s); timeout 240 python3 benchmarks/generate_ab.py --rounds 7 --budget 8192 --profile --gate-up-plan 32,128,4,3,false --attn-launch 4,3 --variants $N,$N+pf,$N+pfs --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -5 $OUT/tests.txt; grep -B2 -A30 "^| variant" $OUT/ab.txt | head -80; grep -E "Error|Traceback|failed" $OUT/ab.txt | head -5
