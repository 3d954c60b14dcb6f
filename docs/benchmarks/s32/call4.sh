#!/usr/bin/env bash
# Session 32 call 4: call 3's failures fixed (the embedder's graphs kept their positions buffer unreferenced;
# the shared-loop test's stand-in config lacked `cache`): those tests and the embedder benchmark again.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 120 python3 benchmarks/decoder_embed.py --device cuda --shape qwen3-0.6b --rounds 5 \
  --json $OUT/decoder_embed.json > $OUT/decoder_embed.txt 2>&1
echo "decoder_embed rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 -m pytest -q tests/gpu/test_decoder_embedder_cuda.py tests/gpu/test_decoder_cuda.py \
  -k "embed or shared_engine_loop" -p no:cacheprovider -rfE > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -n "^E \|FAILED" $OUT/gpu_tests.txt | head -10; grep -v "Loading\|Writing" $OUT/decoder_embed.txt | tail -7
