#!/usr/bin/env bash
# Written in session 27, NOT RUN (no device machine was lent in session 27): generation through `surge serve` on
# the H200 with the engine loop on a thread, in its own process, and shared by 4 front ends (--workers 4; the
# generation hot path and arrivals joining the drained prefill step in all three), against the service in-process
# (Qwen2-0.5B shape, 64 streams, 128 + 128 tokens), then the GPU tests of the service in both modes and of the
# shared engine loop (tests/gpu/test_decoder_cuda.py::test_the_shared_engine_loop_streams_as_the_service_does, new).
# Carry build/whl (fastapi/uvicorn/orjson/httptools/grpcio wheels: the device has none of the server's packages).
# Then: if `process` does not beat `thread` through the server, its GPU default goes off (config.py, README, docs);
# if `workers 4` beats both, consider it the decoder default on a GPU (cli/workers.resolve_workers).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; nproc; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 420 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --rounds 5 --workers 4 --json $OUT/http.json --plot $OUT/http_cdf.png > $OUT/http.txt 2>&1; echo "http rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py -k "service_streams or shared_engine" > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "round|^\|" $OUT/http.txt; tail -3 $OUT/tests.txt
