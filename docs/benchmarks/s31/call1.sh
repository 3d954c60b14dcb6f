#!/usr/bin/env bash
# Session 31 call 1: session 30's GPU paths (Qwen3 / Granite on the unfused layer, cached tokens across the engine
# process), this session's LoRA adapters on the GPU, then what structured outputs cost on the GPU. Carry build/whl.
set +e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > $OUT/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
( nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; date -u ) > $OUT/env.txt 2>&1
python3 -c "import peft" 2>/dev/null || echo "no peft on the device: the LoRA test skips" >> $OUT/env.txt
t=$(date +%s); timeout 300 python3 -m pytest -q -x tests/gpu/test_decoder_cuda.py -p no:cacheprovider \
  -k "unfused or guided or precision or engine_process or prompt_logprobs or lora" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 240 python3 benchmarks/guided.py --device cuda --shape qwen2-0.5b --rounds 3 --json $OUT/guided.json > $OUT/guided.txt 2>&1; echo "guided rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; tail -5 $OUT/gpu_tests.txt; tail -12 $OUT/guided.txt
