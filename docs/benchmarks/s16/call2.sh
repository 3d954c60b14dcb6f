# Session 16, device call 2 (nvidia-h200): one prefill step alone (wall against kernels, cProfile), the round's
# timeline with a burst admitted in one pass (generate service change), and the benchmark.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 150 python3 benchmarks/generate_prefill_host.py --device cuda --shape qwen2-0.5b --prompts 30 --prompts 64 --json $OUT/prefill_host.json > $OUT/prefill_host.txt 2>&1; echo "prefill_host rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate_timeline.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 3 --json $OUT/timeline.json > $OUT/timeline.txt 2>&1; echo "timeline rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 280 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -v "Writing\|Loading" $OUT/prefill_host.txt | grep -A28 "prompts x" | cut -c1-150; grep -v "Writing\|Loading\|Warn\|warn" $OUT/timeline.txt | grep -B2 -A8 "^round\|prefill-only" | head -40; grep "^|\|surge:" $OUT/generate.txt
