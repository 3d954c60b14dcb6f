#!/usr/bin/env bash
# Session 33 call 1: n-gram speculative decoding on the GPU (its test), the decoder's whole GPU test file (session
# 32's review: one rms_norm / rope, the embedder's graph capture), the LoRA-delta and embedder files, then the
# issue's shape with and without speculation (no baseline: call 2 has it). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 330 python3 -m pytest -q tests/gpu/test_decoder_cuda.py tests/gpu/test_decoder_embedder_cuda.py \
  tests/gpu/test_lora_delta_cuda.py -p no:cacheprovider --durations=10 -rfE -s > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 3 \
  --baseline none --speculative-tokens 3 --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/gpu_tests.txt; grep -n "^E \|FAILED\|speculation (graphs" $OUT/gpu_tests.txt | head -30
grep -v "^\[{" $OUT/generate.txt | tail -14
