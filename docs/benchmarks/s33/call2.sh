#!/usr/bin/env bash
# Session 33 call 2: the benchmark (Qwen2-0.5B shape, 64 streams, 128 + 128 tokens) with transformers +
# torch.compile as the baseline in the same run, and surge with n-gram speculation (k = 3) as a row of its own.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 540 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 \
  --compile --speculative-tokens 3 --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -v "^\[{" $OUT/generate.txt | tail -16
