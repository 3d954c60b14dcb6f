#!/usr/bin/env bash
# Session 21, device call 1: the decode attention's EARLY_KV form (first key tile before the PDL wait, the
# step's own key from registers) against session 10's (write, barrier, read): its GPU tests (both forms, bit
# for bit against the two-kernel path, with and without PDL), the launch sweep of both forms at both
# shapes, and the engine A/B at both shapes.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_attention_cuda.py > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for s in qwen2-0.5b llama-1b; do
  t=$(date +%s); timeout 170 python3 benchmarks/gpu_decode_attention.py --shape $s --pdl --json $OUT/attn_$s.json > $OUT/attn_$s.txt 2>&1; echo "attention $s rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
B=argmax+targmax+fa+ta+pdl+sk+gu+tma
t=$(date +%s); timeout 80 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --rounds 7 --attn-launch 4,3 \
    --variants $B+attn256,$B+attn256+ekv > $OUT/ab_qwen.txt 2>&1; echo "ab qwen rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 80 python3 benchmarks/generate_ab.py --shape llama-1b --rounds 7 --attn-launch 4,3 \
    --variants $B+attn128,$B+attn128+ekv > $OUT/ab_llama.txt 2>&1; echo "ab llama rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt
for s in qwen2-0.5b llama-1b; do grep -A14 "heads of" $OUT/attn_$s.txt; done
grep "^|" $OUT/ab_qwen.txt | head -4; grep "^|" $OUT/ab_llama.txt | head -4
