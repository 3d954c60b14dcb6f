"""The decode GEMM kernels' tile product in their two layouts (kernels/splitk_gemm.py, gate_up.py, lora_delta.py).

With M = 64 rows a decode GEMM's tile is [64, BLOCK_N] (the batch on the MMA's long side) or, swapped,
[BLOCK_N, 64] (the weight rows there): which one a plan runs is measured per shape (SplitKPlan.swap).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, w, acc, SWAP: tl.constexpr):
    """acc + a @ w^T, or its transpose (w @ a^T) with SWAP: the weight rows on the MMA's long side. An 8-bit
    w (models/weight_quant.py) is converted to a's dtype first: exact, E4M3's values and -127..127 are all BF16 /
    FP16 values."""
    # one return: Triton's frontend does not prune an early return under a constexpr branch
    w = w.to(a.dtype)
    if SWAP:
        out = tl.dot(w, tl.trans(a), acc)
    else:
        out = tl.dot(a, tl.trans(w), acc)
    return out
