#!/usr/bin/env bash
# Session 18, device call 2: call 1 plus warp-specialized loops, the L2 prefetch on and off, the top three gate/up plans in the chain.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
PYTHONPATH=src timeout 540 python3 benchmarks/gpu_tma_gemm.py --json $OUT/call2_tma_gemm.json 2>&1 | tee $OUT/call2_tma_gemm.txt
