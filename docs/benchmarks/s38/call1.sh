#!/usr/bin/env bash
# Session 38 call 1: every 8-bit product form against BF16 at three model sizes and four row counts
# (benchmarks/gpu_fp8_forms.py: W8A8 FP8 through torch._scaled_mm is new), then the engine's FP8 weight-only rows
# against BF16 at the Llama-1B shape (not measured before). Carry build/whl.
set +e
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/env.txt; date >> $OUT/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:src:.
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
t=$(date +%s); timeout 300 python3 benchmarks/gpu_fp8_forms.py --json $OUT/fp8_forms.json > $OUT/fp8_forms.txt 2>&1
echo "fp8 forms rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
t=$(date +%s); timeout 200 python3 benchmarks/generate.py --device cuda --shape llama-1b --budget 8192 --rounds 2 \
  --baseline none --quantization fp8 --json $OUT/generate_llama_fp8.json > $OUT/generate_llama_fp8.txt 2>&1
echo "generate llama fp8 rc=$? $(( $(date +%s) - t )) s" >> $OUT/env.txt
cat $OUT/env.txt; grep -v "^\[{" $OUT/fp8_forms.txt | tail -45
grep -v "^\[{" $OUT/generate_llama_fp8.txt | grep -E "^\||against|replayed|Error|error" | head -20
