#!/usr/bin/env bash
# Session 29, device call 2: the decoder GPU tests on this session's code: structured outputs on CUDA
# (guided rows beside graph launches), a decoder's precision as set (--precision fp32 runs FP32), and the
# rest of tests/gpu/test_decoder_cuda.py (the sampler and runner changed). llguidance's wheel carried.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 170 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE tests/gpu/test_decoder_cuda.py -k "guided or precision_that" > $OUT/new_tests.txt 2>&1; echo "new tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 380 python3 -m pytest -q -p no:cacheprovider --durations=10 -rfE tests/gpu/test_decoder_cuda.py -k "not guided and not precision_that" > $OUT/decoder_tests.txt 2>&1; echo "decoder tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -15 $OUT/new_tests.txt; tail -4 $OUT/decoder_tests.txt; grep -E "^FAILED|^ERROR" $OUT/decoder_tests.txt | head
