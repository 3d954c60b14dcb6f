#!/usr/bin/env bash
# Session 39 call 4: short prompts through a real `surge serve` (engine process, HTTP streaming completions):
# 1 and 4 concurrent 32-token prompts, graph_prefill_tokens at its default (256) and 0 (eager prefill steps).
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
for s in 1 4; do
  for rows in 256 0; do
    t=$(date +%s); timeout 130 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --streams $s \
      --prompt 32 --output 16 --rounds 15 --clients 1 --engine process --skip-inproc \
      --server-arg=--generation --server-arg=graph_prefill_tokens=$rows > $OUT/http_s${s}_rows${rows}.txt 2>&1
    echo "http streams=$s rows=$rows rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
  done
done
cat $OUT/env.txt; grep -h -E "^\| http|^qwen" $OUT/http_*.txt
