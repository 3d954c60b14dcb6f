#!/usr/bin/env bash
# Session 28, call 2: the shared-engine GPU test (FP32 now on both sides), prompt log-probabilities on CUDA, and generation through `surge serve`
# (engine process, and 4 front ends) with the server's TTFT split into the engine's queue and the prefill (KServe
# statistics), and py-spy profiles of each server (all its processes) over its measured rounds.
# Carry build/whl and build/pyspy (py-spy 0.4.3's manylinux wheel).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl build/pyspy/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
PYSPY=/tmp/site/bin/py-spy
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; nproc; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py -k "shared_engine or prompt_logprobs" > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s)
timeout 400 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --rounds 5 --engine process --workers 4 --json $OUT/http.json > $OUT/http.txt 2>&1 &
bench=$!
for n in 1 2; do
  for i in $(seq 1 600); do [ "$(grep -c 'server ready' $OUT/http.txt)" -ge $n ] && break; sleep 0.5; done
  pid=$(pgrep -o -f "surge.cli.main serve")  # the oldest: the server itself (its front ends and engine are below)
  echo "server $n pid $pid: $(ps -o pid,args -p $pid | tail -1 | cut -c1-150)" >> $OUT/env.txt
  sleep 3
  timeout 30 $PYSPY record -p $pid --subprocesses -r 200 -d 9 -f raw -o $OUT/prof_$n.txt --nonblocking > $OUT/pyspy_$n.txt 2>&1
  echo "py-spy $n rc=$?" >> $OUT/env.txt
done
wait $bench; echo "http rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
# the engine process with one decode step a launch: does the multi-step launches' drain make a burst's TTFT?
t=$(date +%s); timeout 150 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --rounds 4 --engine process --skip-inproc --server-arg=--generation --server-arg=decode_steps=1 --json $OUT/http_ds1.json > $OUT/http_ds1.txt 2>&1; echo "http ds1 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "round|^\|" $OUT/http.txt; grep -E "^\| http" $OUT/http_ds1.txt; tail -3 $OUT/tests.txt; tail -2 $OUT/pyspy_1.txt
