#!/usr/bin/env bash
# Session 32 call 2: the LoRA delta as split-K shrink + expand kernels (tests, and what adapter rows cost against
# the torch form), decoder embedding models on the GPU (test and benchmark). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 240 python3 -m pytest -q tests/gpu/test_lora_delta_cuda.py tests/gpu/test_decoder_embedder_cuda.py \
  tests/gpu/test_decoder_cuda.py -p no:cacheprovider -k "lora or multi_step_launches or embed" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b --streams 64 --prompt 128 \
  --output 128 --rounds 3 --json $OUT/generate_lora.json > $OUT/generate_lora.txt 2>&1
echo "generate_lora rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/decoder_embed.py --device cuda --shape qwen3-0.6b --rounds 5 \
  --json $OUT/decoder_embed.json > $OUT/decoder_embed.txt 2>&1
echo "decoder_embed rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/gpu_tests.txt; grep -n "^E \|FAILED" $OUT/gpu_tests.txt | head -20
grep -v "Loading\|Writing" $OUT/generate_lora.txt | tail -8; tail -6 $OUT/decoder_embed.txt
