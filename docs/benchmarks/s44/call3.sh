#!/usr/bin/env bash
# Session 44, call 3: the generation GPU tests after the failed-step containment merged (the step loop and the
# scheduler every decode path goes through): the decoder, decoder-embedder and LoRA-delta files.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
( nvidia-smi --query-gpu=name --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 480 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=5 tests/gpu/test_decoder_cuda.py tests/gpu/test_decoder_embedder_cuda.py tests/gpu/test_lora_delta_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gpu_tests.txt | cut -c1-300 | head -30
