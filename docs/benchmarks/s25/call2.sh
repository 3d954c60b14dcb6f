#!/usr/bin/env bash
# Session 25, device call 2: the service on the GPU with multi-step launches (new test) and the multi-step GPU
# tests again; the engine's defaults with 1 and 4 decode steps a launch interleaved, the graph also timed with its
# inputs restored before each replay (the multi-step graph moves them on); then the benchmark with the new
# default (decode_steps 4) and transformers + torch.compile in the same run. (Its generate.py run stopped at an
# illegal memory access: the growing-context replay timing of the multi-step graph, fixed for call 3.)
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py -k "multi_step or next_decode_inputs or graph_decode_equals_eager" > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
B=argmax+attn256+targmax+fa+ta+pdl+sk+gu+tma+l2kv
t=$(date +%s); timeout 150 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --budget 8192 --rounds 7 --attn-launch 4,3 --variants $B,$B+ms4 --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 270 python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --budget 8192 --rounds 5 --compile --json $OUT/generate.json > $OUT/generate.txt 2>&1; echo "generate rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head; grep -E "^\||Error|error|failed" $OUT/ab.txt | tail -6; grep -E "^\||surge:|Error|failed" $OUT/generate.txt | tail -12
