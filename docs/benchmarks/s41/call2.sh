#!/usr/bin/env bash
# Session 41, call 2: joiners decoding beside the launches (decode_beside_tokens): the GPU test, then a request
# joining 48 decoding streams through `surge serve` (engine process), 16- and 64-token answers, the setting 0 / 16.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 120 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py -k beside > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for run in "16 0" "16 16" "64 16" "64 0"; do
  set -- $run
  t=$(date +%s); timeout 108 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --streams 1 \
    --prompt 32 --output $1 --rounds 30 --clients 1 --engine process --background 48 --skip-inproc \
    --background-output 2000 --server-arg=--generation --server-arg=decode_beside_tokens=$2 \
    --json $OUT/http_out$1_beside$2.json > $OUT/http_out$1_beside$2.txt 2>&1
  echo "http output $1 beside_tokens=$2 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|prefill beside" $OUT/tests.txt | head
for f in $OUT/http_out*.txt; do echo $f; grep -A3 "^joining" $f | tail -1; done
