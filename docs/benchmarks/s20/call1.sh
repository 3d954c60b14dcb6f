#!/bin/bash
# Session 20, device call 1: split-K (pointer and TMA) and gate/up plans for the Llama-1B shape's decode
# GEMMs (issue 18), measured against cuBLAS at M = 64 with the GEMM's reader / the MLP chain.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
export PYTHONPATH=src
git log --oneline -1
timeout 360 python3 benchmarks/gpu_splitk_tune.py --shape llama-1b --tma --workers 14 \
    --json $OUT/sk_llama.json > $OUT/sk_llama.txt 2>&1; echo "splitk rc=$?"
tail -25 $OUT/sk_llama.txt
timeout 200 python3 benchmarks/gpu_gate_up_tune.py --shape llama-1b --tma --workers 14 \
    --splitk-plans $OUT/sk_llama.json --json $OUT/gu_llama.json > $OUT/gu_llama.txt 2>&1; echo "gate_up rc=$?"
tail -30 $OUT/gu_llama.txt
