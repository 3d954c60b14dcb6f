# Session 10, device call 5 (nvidia-h200): launch shapes of the one-kernel decode attention (keys a tile,
# warps, stages; benchmarks/gpu_decode_attention.py), then the best one in the engine against the default,
# interleaved.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 150 python3 benchmarks/gpu_decode_attention.py --json $OUT/attn.json > $OUT/attn.txt 2>&1; echo "attn rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
BEST=$(python3 -c "import json; r=[x for x in json.load(open('$OUT/attn.json'))['rows'] if x['path']=='decode_attention']; b=min(r,key=lambda x:x['us']); print(b['block_n'], str(b['num_warps'])+','+str(b['num_stages']))" 2>/dev/null || echo "256 4,2")
set -- $BEST
echo "best attention launch: block_n $1, warps,stages $2" >> $OUT/env.txt
N=argmax+attn256+targmax+sk+fa+pdl+gu
T=argmax+attn$1+targmax+sk+fa+pdl+gu+ta
t=$(date +%s); timeout 150 python3 benchmarks/generate_ab.py --rounds 7 --budget 8192 --gate-up-plan 32,128,4,3,false --attn-launch $2 --variants $N,$T --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -A14 "^| path" $OUT/attn.txt; grep -A4 "^| variant" $OUT/ab.txt; grep -E "Error|Traceback|failed" $OUT/attn.txt $OUT/ab.txt | head -5
