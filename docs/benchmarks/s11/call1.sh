# Session 11, device call 1 (nvidia-h200): the whole GPU test directory on the code session 10 ended with
# (the decode-attention launch shape (4, 3) was only checked by its sweep then), and the issue-18 benchmark once.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/gpu > $OUT/tests_gpu.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/compile.json > $OUT/compile.txt 2>&1; echo "compile rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/tests_gpu.txt; grep -E "^\||replayed" $OUT/compile.txt; grep -E "Error|Traceback|failed" $OUT/compile.txt | head -5
