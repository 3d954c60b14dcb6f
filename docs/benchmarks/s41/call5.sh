#!/usr/bin/env bash
# Session 41, call 5: the decoder's GPU tests on the session's final loop code (a stopped sequence left out of the
# launch after a read-back; the loop's books when the engine raises).
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
t=$(date +%s); timeout 230 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py > $OUT/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|prefill beside" $OUT/tests.txt | head
