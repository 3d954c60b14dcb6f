#!/usr/bin/env bash
# Session 25, device call 6: decode_launch_ms (a multi-step launch capped by the step time each bucket measured
# after capture): the multi-step GPU tests with the new asserts, then Llama-1B (1.2 ms steps: 3 steps a launch
# under 4 ms) and Qwen2-0.5B (4) on the defaults, surge only.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
t=$(date +%s); timeout 80 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_decoder_cuda.py -k "multi_step or service_streams" > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
for s in llama-1b qwen2-0.5b; do
  t=$(date +%s); timeout 40 python3 benchmarks/generate.py --device cuda --shape $s --budget 8192 --rounds 3 --baseline none --json $OUT/generate_$s.json > $OUT/generate_$s.txt 2>&1; echo "generate $s rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
done
cat $OUT/env.txt; tail -2 $OUT/gpu_tests.txt; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head; for s in llama-1b qwen2-0.5b; do grep -E "^\| surge|surge:|Error" $OUT/generate_$s.txt | head -5; done
