#!/usr/bin/env bash
# Session 18, device call 3 (nvidia-h200): the TMA plans in the engine (o, down and gate/up read by TMA):
# GPU tests (TMA == pointer loads bit for bit, the engine against transformers), the engines interleaved
# (session 16's engine N against N+tma: tok/s, ITL, the bucket-64 graph replayed alone), the issue's benchmark.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
N=argmax+attn256+targmax+sk+fa+pdl+gu+ta
t=$(date +%s); timeout 190 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tma_gemm_cuda.py tests/gpu/test_decoder_cuda.py tests/gpu/test_gate_up_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 160 python3 benchmarks/generate_ab.py --rounds 7 --budget 8192 --profile --attn-launch 4,3 --variants $N,$N+tma --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 160 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/compile.json > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/tests.txt; grep -E "^FAILED|^E  " $OUT/tests.txt | head -20; grep -v "Writing\|Loading\|Warn\|warn" $OUT/ab.txt | tail -40 | cut -c1-220; grep "^|\|surge:" $OUT/generate.txt
