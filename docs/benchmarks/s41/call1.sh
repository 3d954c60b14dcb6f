#!/usr/bin/env bash
# For the next session with a device (session 40's device time was spent): the decoder's GPU tests on session 40's
# final code (the one-token prompt chunk beside, the hub's wait were CPU-tested only), and requests joining 48
# decoding streams through `surge serve --workers 2` (front ends sharing the engine process through the hub, whose
# wait now ends on an arrival), prefill_beside on and off.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 190 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for b in true false; do
  t=$(date +%s); timeout 190 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --streams 1 \
    --prompt 32 --output 16 --rounds 30 --clients 1 --engine process --workers 2 --background 48 \
    --background-output 2000 --server-arg=--generation --server-arg=prefill_beside=$b \
    --json $OUT/http_workers_beside_$b.json > $OUT/http_workers_beside_$b.txt 2>&1
  echo "http workers 2 beside=$b rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|prefill beside" $OUT/tests.txt | head
for b in true false; do grep -A4 "^joining" $OUT/http_workers_beside_$b.txt; done
