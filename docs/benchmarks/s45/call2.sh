#!/usr/bin/env bash
# Session 45, call 2: the rest of tests/gpu/test_decoder_cuda.py that call 1's 150 s bound cut (its first 22 tests
# passed there): speculative steps (decoder/speculative.py after the split), LoRA, guided rows, prefetch, the rest.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
K="fused_decode_attention or l2_prefetch or bulk_prefetch or prompt_logprobs or guided_rows or precision_that or unfused_layer or lora_adapters or speculative or draft_model"
t=$(date +%s); timeout 220 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 tests/gpu/test_decoder_cuda.py -k "$K" > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | head -20
