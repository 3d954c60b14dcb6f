#!/usr/bin/env bash
# Session 33 call 7: n-gram speculation through a real `surge serve` (the engine loop in its own process, the GPU
# default; streaming /v1/completions, detokenized), Qwen2-0.5B shape, 4 and 16 streams, 128 + 128 tokens: the server
# without speculation, then with speculative_tokens=3 and no batch cap. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
for streams in 4 16; do
  for spec in none k3; do
    extra=""; [ $spec = k3 ] && extra="--server-arg=--generation --server-arg=speculative_tokens=3,speculative_max_batch=64"
    t=$(date +%s); timeout 140 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --streams $streams \
      --rounds 3 --clients 2 --engine process --skip-inproc $extra > $OUT/http_s${streams}_$spec.txt 2>&1
    echo "streams $streams $spec rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
  done
done
cat $OUT/env.txt; for f in $OUT/http_*.txt; do echo "== $f"; grep -E "round|^\|" $f | tail -6; done
