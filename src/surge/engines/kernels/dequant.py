"""8-bit weights dequantized in one pass (Triton): q [N, K] (float8_e4m3fn or int8) * scale[:, None] -> BF16 / FP16.

Above the row counts where the 8-bit split-K kernel pays (splitk_gemm.Q8_MAX_M: prefill chunks, decode steps of
many streams) the engine multiplies by the weight dequantized for the call with cuBLAS. torch's form of the same
arithmetic (models/weight_quant.dequantize) writes and reads FP32 copies of the weight on the way (three kernels,
~19 bytes moved an element) where this kernel moves 3: one byte read, two written (benchmarks/gpu_q8_rows.py
times both: 4-7x faster on an H100).

Same bits as models/weight_quant.dequantize: the code converted to FP32 exactly, one FP32 product with the row's
scale, rounded once (to nearest even) to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 16
BLOCK_K = 256


@triton.jit
def _dequant(q_ptr, s_ptr, out_ptr, n, k, stride_q, stride_o, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < n)[:, None] & (cols < k)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    q = tl.load(q_ptr + r64 * stride_q + cols[None, :], mask=mask)
    s = tl.load(s_ptr + rows, mask=rows < n, other=1.0)
    w = q.to(tl.float32) * s[:, None]
    tl.store(out_ptr + r64 * stride_o + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, K] 8-bit (rows of unit column stride) with scale [N] FP32 -> [N, K] of `dtype` (BF16 / FP16), written into
    `out` where given (same shape and dtype); equal bit for bit to models/weight_quant.dequantize."""
    if q.dim() != 2 or scale.shape != (q.shape[0],):
        raise ValueError(f"dequantize takes q [N, K] and scale [N], not {list(q.shape)} and {list(scale.shape)}")
    if q.stride(1) != 1:
        q = q.contiguous()
    n, k = q.shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a [N, K] {dtype} tensor of unit column stride")
    scale = scale.float().contiguous()
    _dequant[(triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))](q, scale, out, n, k, q.stride(0), out.stride(0),
                                                                 BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
