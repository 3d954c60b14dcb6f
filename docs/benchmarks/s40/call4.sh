#!/usr/bin/env bash
# Session 40 call 4: through a real `surge serve` (engine process, streaming /v1/completions over HTTP): 32-token
# requests, one at a time, joining 48 streams that decode throughout (each asked again when it ends); prefill_beside
# on (the default) and off. (The first try asked 8,000 tokens of a 4,096-token model and hung: call4_failed.)
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
for b in true false; do
  t=$(date +%s); timeout 110 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --streams 1 \
    --prompt 32 --output 16 --rounds 30 --clients 1 --engine process --background 48 --background-output 2000 \
    --server-arg=--generation --server-arg=prefill_beside=$b --json $OUT/http_beside_$b.json > $OUT/http_beside_$b.txt 2>&1
  echo "http beside=$b rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; for b in true false; do grep -E "background:|ready in" $OUT/http_beside_$b.txt; tail -4 $OUT/http_beside_$b.txt | grep -v '^{'; done
