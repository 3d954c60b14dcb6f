#!/usr/bin/env bash
# Session 37 call 2: the benchmark (compiled transformers in the same run) with an FP8 row; 8-bit weights at
# 128 streams (decode steps of 128 rows: the split-K kernel's M tiles) beside BF16 at 128 in one run; one prefill step of the 64 prompts
# alone (wall against kernels, the host's hot spots); then the BF16 decoder GPU suite (not run since session 35's kernels). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 300 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 \
  --compile --quantization fp8 --json $OUT/generate.json > $OUT/generate.txt 2>&1
echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 120 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 3 \
  --streams 128 --baseline none --quantization fp8 --json $OUT/generate128.json > $OUT/generate128.txt 2>&1
echo "generate128 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 90 python3 benchmarks/generate_prefill_host.py --device cuda --shape qwen2-0.5b --prompts 64 \
  > $OUT/prefill_host.txt 2>&1
echo "prefill host rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 160 python3 -m pytest -q -p no:cacheprovider --durations=5 -rfE tests/gpu/test_decoder_cuda.py \
  -k "bf16_trained_model or multi_step or graph" > $OUT/decoder_tests.txt 2>&1
echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/decoder_tests.txt; grep -E "^FAILED|^ERROR" $OUT/decoder_tests.txt | head
for f in $OUT/generate.txt $OUT/generate128.txt; do grep -v "^\[{" $f | grep -E "^\||against|replayed|Error|error" | head -20; done
