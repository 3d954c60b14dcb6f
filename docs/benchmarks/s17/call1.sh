# Session 17, device call 1 (nvidia-h200): the protocol-level embedding path (server/http/direct.py) on the GPU
# host, where the --workers front ends' event loops bound throughput: this code (`surge`) against the session's
# start (`surge-prev`, PYTHONPATH of c999566's src, carried as build/base_src), two rounds in both orders.
# (The call's first try had no web stack there: build/whl now also carries fastapi, starlette, uvicorn, httptools,
# orjson, opentelemetry-api and annotated-doc.)
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
python3 -c "import fastapi, uvicorn, httptools, orjson, uvloop, prometheus_client; from surge.server.app import create_app; import surge.cli.workers, surge.server.http.direct" > $OUT/imports.txt 2>&1 || { cat $OUT/pip.txt $OUT/imports.txt | tail -20; exit 1; }
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; nproc; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 540 python3 benchmarks/gpu_serving.py --files build/st_files --models-dir /tmp/models --duration 3 --warmup 0.5 --load-procs 4 --clients 16,64,256 --models minilm --servers surge-prev,surge,surge,surge-prev --surge "surge-prev=PYTHONPATH=/tmp/site:$PWD/build/base_src" --budget-s 420 --out $OUT/gs > $OUT/serving.txt 2>&1; echo "serving rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep "^|" $OUT/serving.txt | cut -c1-220
