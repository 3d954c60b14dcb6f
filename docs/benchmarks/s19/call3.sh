#!/usr/bin/env bash
# Session 19, device call 3 (nvidia-h200): the benchmark for its second shape, Llama-1B (last measured in
# session 1, before the split-K / PDL / fused-layer / TMA engine), against transformers + torch.compile.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 420 python3 benchmarks/generate.py --device cuda --shape llama-1b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep "^|\|surge:\|Error\|error" $OUT/generate.txt | tail -12
