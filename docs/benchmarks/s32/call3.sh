#!/usr/bin/env bash
# Session 32 call 3: the decoder embedder's CUDA graphs (test and benchmark, graphs against eager against
# transformers), and the decoder's whole GPU test file on the session's final engine code. Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 120 python3 benchmarks/decoder_embed.py --device cuda --shape qwen3-0.6b --rounds 5 \
  --json $OUT/decoder_embed.json > $OUT/decoder_embed.txt 2>&1
echo "decoder_embed rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 300 python3 -m pytest -q tests/gpu/test_decoder_embedder_cuda.py tests/gpu/test_lora_delta_cuda.py \
  tests/gpu/test_decoder_cuda.py -p no:cacheprovider --durations=10 -rfE > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/gpu_tests.txt; grep -n "^E \|FAILED" $OUT/gpu_tests.txt | head -20; tail -7 $OUT/decoder_embed.txt
