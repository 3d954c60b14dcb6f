#!/usr/bin/env bash
# Session 41, call 3: where a decode step beside the launches goes (in-process, engine thread: host wall time and
# the beside stream's span), and the two settings that shorten what a joiner queues behind (overlap_depth 1,
# decode_steps 2) through `surge serve`.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 220 python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b --lengths 32 \
  --repeats 10 --rows 512 --beside 1 --beside-tokens 0 16 --joins 48 --interval 20 --background 48 \
  --json $OUT/ttft.json > $OUT/ttft.txt 2>&1
echo "ttft rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for gen in overlap_depth=1 decode_steps=2; do
  t=$(date +%s); timeout 100 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --streams 1 \
    --prompt 32 --output 16 --rounds 30 --clients 1 --engine process --background 48 --skip-inproc \
    --background-output 2000 --server-arg=--generation --server-arg=$gen \
    --json $OUT/http_$gen.json > $OUT/http_$gen.txt 2>&1
  echo "http $gen rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; grep -A12 "^| |" $OUT/ttft.txt
for f in $OUT/http_*.txt; do echo $f; grep -A3 "^joining" $f | tail -1; done
