#!/usr/bin/env bash
# Session 25, device call 3: the engine's defaults with 1 and 4 decode steps a launch interleaved (every graph also
# timed with its inputs restored before each replay, the only sound way for a graph that moves them on), then the
# issue's benchmark on the new default (decode_steps 4) with transformers + torch.compile in the same run.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
B=argmax+attn256+targmax+fa+ta+pdl+sk+gu+tma+l2kv
t=$(date +%s); timeout 150 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --budget 8192 --rounds 7 --attn-launch 4,3 --variants $B,$B+ms4 --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 330 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^\||Error|error|failed" $OUT/ab.txt | tail -6; grep -E "^\||surge:|Error|failed" $OUT/generate.txt | tail -12
