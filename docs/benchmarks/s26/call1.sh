#!/usr/bin/env bash
# Session 26, device call 1: generation through a real `surge serve` process (HTTP, SSE, detokenized)
# against the same service in-process, Qwen2-0.5B shape, 64 streams, 128 + 128 tokens.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; nproc;
  python3 -c "import uvicorn, starlette, httpx, tokenizers, transformers; print('deps ok', uvicorn.__version__, httpx.__version__)" ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 420 python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --rounds 5 --json $OUT/http.json > $OUT/http.txt 2>&1; echo "http rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -v "^{" $OUT/http.txt | tail -25
