#!/usr/bin/env bash
# Session 25, device call 1: multi-step launches (GenerationConfig.decode_steps). The decoder's GPU tests (the
# new input kernel and multi-step launches against the eager engine included), then the engine's defaults with
# 1, 2, 4 and 8 decode steps a launch, interleaved (benchmarks/generate_ab.py), on a quiet host and with one
# Python thread computing beside the loop.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; nproc; python3 -c "import platform; print(platform.processor(), platform.python_version())" ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 280 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE tests/gpu/test_decoder_cuda.py > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
B=argmax+attn256+targmax+fa+ta+pdl+sk+gu+tma+l2kv
t=$(date +%s); timeout 270 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --budget 8192 --rounds 7 --attn-launch 4,3 --busy-threads 1 --variants $B,$B+ms2,$B+ms4,$B+ms8 --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head; grep -E "^\||Error|error|failed" $OUT/ab.txt | tail -14
