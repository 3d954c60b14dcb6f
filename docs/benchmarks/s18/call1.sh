#!/usr/bin/env bash
# Session 18, device call 1: the layer GEMMs with TMA weight loads against the engine's kernels.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
PYTHONPATH=src timeout 540 python3 benchmarks/gpu_tma_gemm.py --json $OUT/call1_tma_gemm.json 2>&1 | tee $OUT/call1_tma_gemm.txt
