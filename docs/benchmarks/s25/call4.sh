#!/usr/bin/env bash
# Session 25, device call 4: the stream-K gate/up (kernels/gate_up_streamk.py, new): its GPU tests and the
# engine with it against transformers, then alone / in the MLP chain against the engine's gate/up kernel
# (benchmarks/gpu_gate_up_streamk.py, both shapes), then the engine A/B (generate_ab.py, the defaults with and
# without it, 4 decode steps a launch).
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 170 python3 -m pytest -q -x -p no:cacheprovider -rfE tests/gpu/test_gate_up_streamk_cuda.py "tests/gpu/test_decoder_cuda.py::test_streamk_gate_up_in_the_engine_follows_transformers" > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for s in qwen2-0.5b llama-1b; do
  t=$(date +%s); timeout 100 python3 benchmarks/gpu_gate_up_streamk.py --shape $s --json $OUT/streamk_$s.json > $OUT/streamk_$s.txt 2>&1; echo "streamk $s rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
B=argmax+attn256+targmax+fa+ta+pdl+sk+gu+tma+l2kv+ms4
t=$(date +%s); timeout 130 python3 benchmarks/generate_ab.py --shape qwen2-0.5b --budget 8192 --rounds 7 --attn-launch 4,3 --variants $B,$B+gusk --json $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR|Error" $OUT/gpu_tests.txt | head -8
for s in qwen2-0.5b llama-1b; do grep -E "^check|^ +[0-9]|Error|error" $OUT/streamk_$s.txt | head -30; done
grep -E "^\||Error|error|failed" $OUT/ab.txt | tail -6
