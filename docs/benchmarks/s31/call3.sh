#!/usr/bin/env bash
# Session 31 call 3: the LoRA GPU tests with peft 0.21 (call 1's peft 0.17 does not import under the device's
# transformers), base-model batches on graphs without the adapters' GEMMs, and what slots cost again. Carry build/whl.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 150 python3 -m pytest -q tests/gpu/test_decoder_cuda.py -p no:cacheprovider -k "lora or multi_step_launches" \
  > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc=$? $(( $(date +%s) - t )) s" > $OUT/env.txt
t=$(date +%s); timeout 120 python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b --streams 64 --prompt 128 \
  --output 128 --rounds 2 --json $OUT/generate_lora.json > $OUT/generate_lora.txt 2>&1
echo "generate_lora rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/gpu_tests.txt; grep -n "^E " $OUT/gpu_tests.txt | head; grep -v "Loading\|Writing" $OUT/generate_lora.txt | tail -6
