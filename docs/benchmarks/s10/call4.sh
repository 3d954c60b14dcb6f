# Session 10, device call 4 (nvidia-h200): two launched decode steps in flight (StepLoop depth 2, the new
# default) against one (depth 1, sessions 2-9) and three; the decoder GPU tests with the new loop; the issue's
# benchmark at the final defaults with the compiled transformers baseline in the same process.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 120 python3 -m pytest -q tests/gpu/test_decoder_cuda.py > $OUT/tests_decoder.txt 2>&1; echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
S8=argmax+attn256+targmax+sk
N=$S8+fa+pdl+gu
t=$(date +%s); timeout 150 python3 benchmarks/generate_ab.py --rounds 7 --budget 8192 --gate-up-plan 32,128,4,3,false --variants $S8+d1,$N+d1,$N,$N+d3 --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/compile.json > $OUT/compile.txt 2>&1; echo "compile rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 60 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --baseline none > $OUT/gen2.txt 2>&1; echo "gen2 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -1 $OUT/tests_decoder.txt; grep -A6 "^| variant" $OUT/ab.txt; grep -E "^\||replayed" $OUT/compile.txt $OUT/gen2.txt; grep -E "Error|Traceback|failed" $OUT/ab.txt $OUT/compile.txt | head -5
