# Session 16, device call 3 (nvidia-h200): rope_and_cache with 16 tokens a program in prefill steps: GPU tests
# (the new tiled-vs-one-token file, the decode attention's bit-for-bit file, the decoder engine against
# transformers), the round's timeline and the benchmark.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_rope_cache_cuda.py tests/gpu/test_decode_attention_cuda.py tests/gpu/test_decoder_cuda.py tests/gpu/test_splitk_gemm_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 benchmarks/generate_timeline.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 3 --json $OUT/timeline.json > $OUT/timeline.txt 2>&1; echo "timeline rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/tests.txt; grep -E "^FAILED|^E  " $OUT/tests.txt | head -20; grep -v "Writing\|Loading\|Warn\|warn" $OUT/timeline.txt | grep -A4 "^round\|prefill-only\|_rope_cache\|Self CUDA time" | cut -c1-200 | head -40; grep "^|\|surge:" $OUT/generate.txt
