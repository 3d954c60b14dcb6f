#!/usr/bin/env bash
# Session 43, call 2: call 1's pytest ran out of its 420 s at test 294 of 325 (the bundled-model tests, which had
# errored in session 42 for want of the model, now ran and took the time) with four failures in its first line and
# no report of them. Here: those four with their tracebacks, then the files call 1 did not reach.
set +e
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/gpu/test_decoder_cuda.py -k "l2_prefetch or bulk_prefetch or fused_decode_attention" > $OUT/prefetch_tests.txt 2>&1
echo "prefetch tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --durations=10 tests/gpu/test_weight_quant_cuda.py > $OUT/weight_quant_tests.txt 2>&1
echo "weight quant tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|Error" $OUT/prefetch_tests.txt | cut -c1-300 | head -30; tail -3 $OUT/weight_quant_tests.txt
