#!/usr/bin/env bash
# Session 21, device call 2: the decode attention's four KV_FORMS (barrier: session 10's write / barrier / read;
# registers: call 1's first tile loaded before the PDL wait; l2 / l2_registers: the first tile's lines only
# asked into L2 before the wait) swept at both shapes with their registers and spills, then the engine A/B of
# barrier against the two L2 forms at both shapes.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
for s in qwen2-0.5b llama-1b; do
  t=$(date +%s); timeout 175 python3 benchmarks/gpu_decode_attention.py --shape $s --pdl --json $OUT/attn_$s.json > $OUT/attn_$s.txt 2>&1; echo "attention $s rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
B=argmax+targmax+fa+ta+pdl+sk+gu+tma
t=$(date +%s); timeout 90 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --rounds 7 --attn-launch 4,3 \
    --variants $B+attn256,$B+attn256+kv=l2,$B+attn256+kv=l2_registers > $OUT/ab_qwen.txt 2>&1; echo "ab qwen rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 90 python3 benchmarks/generate_ab.py --shape llama-1b --rounds 7 --attn-launch 4,3 \
    --variants $B+attn128,$B+attn128+kv=l2,$B+attn128+kv=l2_registers > $OUT/ab_llama.txt 2>&1; echo "ab llama rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt
for s in qwen2-0.5b llama-1b; do grep "WRONG\|failed\|no register" $OUT/attn_$s.txt | head -5; grep -A18 "heads of" $OUT/attn_$s.txt; done
grep "^|" $OUT/ab_qwen.txt | head -5; grep "^|" $OUT/ab_llama.txt | head -5
