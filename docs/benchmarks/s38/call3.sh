#!/usr/bin/env bash
# Session 38 call 3: the engine at the Llama-3-8B shape (random BF16 weights, 16 GB), BF16 / fp8 (W8A8 norm-fed
# products) / fp8 weight-only in one run, 64 streams, 128 + 128 tokens. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
df -h /tmp | tail -1 >> $OUT/env.txt
t=$(date +%s); timeout 500 python3 benchmarks/generate.py --device cuda --shape llama-8b --budget 8192 --rounds 2 \
  --baseline none --quantization fp8 --quantization fp8-weight-only --json $OUT/gen_llama-8b.json > $OUT/gen_llama-8b.txt 2>&1
echo "generate llama-8b rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt
grep -v "^\[{" $OUT/gen_llama-8b.txt | grep -E "^\||against|replayed|Error|error|Traceback" | head -20; tail -5 $OUT/gen_llama-8b.txt
