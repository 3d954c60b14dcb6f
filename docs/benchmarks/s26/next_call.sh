#!/usr/bin/env bash
# Written in session 26, NOT RUN (the device was lost after call 1 and no machine was lent again): the measurement
# the engine-process default on a GPU waits for. Generation through `surge serve` with the engine loop on a thread
# and in its own process, against the service in-process (Qwen2-0.5B shape, 64 streams, 128 + 128 tokens), then
# the GPU tests of the service in both modes. Carry build/whl (its fastapi/uvicorn/orjson/httptools/grpcio wheels
# are what `surge serve` needs there).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 300 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --rounds 5 --json $OUT/http.json --plot $OUT/http_cdf.png > $OUT/http.txt 2>&1; echo "http rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py -k "service_streams" > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "round|^\|" $OUT/http.txt; tail -3 $OUT/tests.txt
