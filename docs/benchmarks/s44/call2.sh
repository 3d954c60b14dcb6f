#!/usr/bin/env bash
# Session 44, call 2: (1) which one tiling the batch-invariant encoder should use (benchmarks/gpu_invariant_tiles.py:
# candidates against the per-bucket engine, same process); (2) what batch invariance costs end to end: `surge serve`
# of a random-weight MiniLM (fp16, torch engine on the GPU) with batch_invariant on (the default, `surge`) and off
# (`surge-free`), alternating, closed-loop clients sending one real sentence a request (benchmarks/gpu_serving.py).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
mkdir -p build/gpuwork && cp -r build/gpucarry/minilm build/gpuwork/ && xz -d -c build/gpucarry/model.safetensors.xz > build/gpuwork/minilm/model.safetensors
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; nproc; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 200 python3 benchmarks/gpu_invariant_tiles.py --model-dir build/gpuwork/minilm --json $OUT/tiles.json > $OUT/tiles.txt 2>&1; echo "tiles rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 330 python3 benchmarks/gpu_serving.py --files build/gpucarry/minilm --models-dir /tmp/models --duration 3 --warmup 0.5 --load-procs 4 --clients 1,16,64,256 --models minilm --servers surge,surge-free,surge-free,surge --surge "surge-free=--no-batch-invariant" --budget-s 280 --out $OUT/gs > $OUT/serving.txt 2>&1; echo "serving rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep "^|" $OUT/tiles.txt | cut -c1-260; grep "error" $OUT/tiles.txt | cut -c1-200 | head; grep "^|" $OUT/serving.txt | cut -c1-220; tail -3 $OUT/serving.txt
