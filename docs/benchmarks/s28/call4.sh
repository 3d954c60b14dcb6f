#!/usr/bin/env bash
# Session 28, call 4 (03:56 UTC): a burst held at an idle engine (GenerationConfig.burst_wait_ms 4, burst_quiet_ms 1,
# commit dcab7d6; removed after this call: no gain) against
# the default through `surge serve` (engine process), Qwen2-0.5B shape, 64 streams. Carry build/whl.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
for v in default burst; do
  case $v in burst*) extra="--server-arg=--generation --server-arg=burst_wait_ms=4,burst_quiet_ms=1";; *) extra="";; esac
  t=$(date +%s); timeout 100 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --rounds 4 --engine process --skip-inproc $extra --json $OUT/http_$v.json > $OUT/http_$v.txt 2>&1
  echo "$v rc=$? $(( $(date +%s) - t )) s: $(grep -E '^\| http' $OUT/http_$v.txt)"
done
