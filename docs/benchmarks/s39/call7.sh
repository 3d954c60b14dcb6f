#!/usr/bin/env bash
# Session 39 call 7: the decoder's GPU tests on the final code (graph_prefill_tokens 512 in replays of <= 256 rows,
# the key bound, the staging sets' events).
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 235 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed" $OUT/tests.txt | head
