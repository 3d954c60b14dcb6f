#!/usr/bin/env bash
# Session 24, device call 2: the decode attention's "early" form (the first key tile's table entries before the
# PDL wait, its keys and values loaded right after it beside the QKV partials, the step's own key and value
# joined from registers; decode_attention.EARLY_FIRST_TILE): its GPU test (bit for bit against rope_and_cache +
# paged_attention), the launch sweep with every form, and the engine A/B at both shapes.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_attention_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/gpu_decode_attention.py --pdl --json $OUT/attn_qwen.json > $OUT/attn_qwen.txt 2>&1; echo "attn sweep rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
B=argmax+targmax+fa+ta+pdl+sk+gu+tma+l2kv
t=$(date +%s); timeout 150 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --rounds 7 --attn-launch 4,3 \
    --variants $B+attn256,$B+attn256+early > $OUT/ab_qwen.txt 2>&1; echo "ab qwen rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate_ab.py --shape llama-1b --rounds 7 --attn-launch 4,3 \
    --variants $B+attn128,$B+attn128+early > $OUT/ab_llama.txt 2>&1; echo "ab llama rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/tests.txt; grep -E "^FAILED|^ERROR" $OUT/tests.txt | head
grep -E "^\|" $OUT/attn_qwen.txt | sort -t'|' -k8 -n | head -3; grep -E "True \| (64|128|256)" $OUT/attn_qwen.txt | grep "decode_attention" | head -12
grep -E "^\||Error" $OUT/ab_qwen.txt | head -6; grep -E "^\||Error" $OUT/ab_llama.txt | head -6
