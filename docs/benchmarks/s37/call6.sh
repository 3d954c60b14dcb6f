#!/usr/bin/env bash
# Session 37 call 6: the second shape (Llama-1B) on this session's code, compiled transformers in the same
# run (last measured in session 25, on an H200). Carry build/whl.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate.py --device cuda --shape llama-1b --budget 8192 --rounds 3 --compile \
  --json $OUT/generate_llama.json > $OUT/generate_llama.txt 2>&1
echo "generate llama rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -v "^\[{" $OUT/generate_llama.txt | grep -E "^\||against|replayed|Error|error" | head -12
