"""Mean pooling of packed sequences in one fixed summation order.

Each program sums one sequence's rows for a slice of columns, in chunks of BLOCK_T rows counted
from the sequence's own first token, then reduces the chunk's rows by one fixed tree. So a
sentence's mean is bit for bit the same wherever it sits in the packed batch and whatever else the
batch holds (a [batch, tokens] membership matrix through cuBLAS summed in an order that followed
the sequence's offset and the bucket's kernel choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
BLOCK_H = 128


@triton.jit
def _segment_mean(x_ptr, cu_ptr, out_ptr, stride_x, H, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        acc += tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                       mask=(rows[:, None] < end) & cmask[None, :], other=0.0).to(tl.float32)
    count = tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + seq * H + cols, tl.sum(acc, 0) / count, mask=cmask)


def segment_mean(x: torch.Tensor, cu_seqlens: torch.Tensor, batch: int) -> torch.Tensor:
    """[batch, H] float32 means of x's rows cu_seqlens[i]:cu_seqlens[i+1] (an empty sequence: 0)."""
    h = x.shape[1]
    out = torch.empty((batch, h), dtype=torch.float32, device=x.device)
    _segment_mean[(batch, triton.cdiv(h, BLOCK_H))](x, cu_seqlens, out, x.stride(0), h,
                                                     BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, num_warps=4)
    return out
