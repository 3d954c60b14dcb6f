#!/usr/bin/env bash
# Session 19, device call 1 (nvidia-h200): HEAD (21582d8) checked on the GPU: the whole GPU suite (session 18's
# review asserts in test_tma_gemm_cuda.py never ran on a GPU), then the benchmark on the final code.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u; git log --oneline -1 ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=15 tests/gpu > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 170 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head -20; grep "^|\|surge:" $OUT/generate.txt
