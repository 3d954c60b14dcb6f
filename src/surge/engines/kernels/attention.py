"""Attention over packed sequences (no padding), FlashAttention-style.

Reads Q, K and V straight out of the fused QKV GEMM's output [T, 3*hid]
(no transposes, no padding to the longest sequence) and writes the context
[T, hid]. One program = one block of queries of one (sequence, head); keys are
streamed in blocks with an online softmax in fp32, so the [L, L] score matrix
never reaches memory. Sequences are located by cu_seqlens; programs past a
sequence's end exit at once, which is what lets one CUDA graph serve every
batch whose longest sequence fits its length bucket.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _varlen_attn(qkv_ptr, out_ptr, cu_ptr, stride_t, stride_o, qk_scale,
                 HEADS: tl.constexpr, D: tl.constexpr, HID: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    seq = pid_bh // HEADS
    head = pid_bh % HEADS
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    if pid_m * BLOCK_M >= length:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    rows = (start + offs_m).to(tl.int64)
    q = tl.load(qkv_ptr + rows[:, None] * stride_t + head * D + offs_d[None, :],
                mask=(offs_m[:, None] < length) & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < length
        krows = (start + offs_n).to(tl.int64)
        k = tl.load(qkv_ptr + krows[None, :] * stride_t + HID + head * D + offs_d[:, None],
                    mask=nmask[None, :] & dmask[:, None], other=0.0)
        # ieee: an FP32 cache attends in FP32 (Triton's default for FP32 dots is TF32, which moved
        # logits by ~1e-3); BF16 / FP16 inputs ignore it
        s = tl.dot(q, k, input_precision="ieee") * qk_scale  # log2 domain: exp2 below
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(qkv_ptr + krows[:, None] * stride_t + 2 * HID + head * D + offs_d[None, :],
                    mask=nmask[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    acc = acc / l_i[:, None]
    orows = (start + offs_m).to(tl.int64)
    tl.store(out_ptr + orows[:, None] * stride_o + head * D + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < length) & dmask[None, :])


# The tile of every batch when the caller asks for batch invariance: a sequence's softmax sums and
# products then run in one order whatever the batch's longest sequence (which otherwise picks the
# tile: a 10-token query alone ran 16 x 16 tiles, beside a 40-token one 64 x 64, and rounded apart).
INVARIANT_BLOCK = 64


def varlen_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor, heads: int,
                     max_len: int, batch: int | None = None, invariant: bool = False) -> torch.Tensor:
    """qkv [T, 3*heads*D] (fp16/bf16), cu_seqlens int32 [B+1] on the GPU -> out [T, heads*D].

    `max_len` and `batch` size the grid only (upper bounds are fine): they are
    what a CUDA graph fixes, while cu_seqlens' contents may change per replay.
    invariant: one tile shape for every max_len, so each sequence's output is bit for bit
    the same whatever shares its batch; otherwise the tile follows max_len (faster for short ones).
    """
    hid = qkv.shape[1] // 3
    d = hid // heads
    if batch is None:
        batch = cu_seqlens.shape[0] - 1
    block_d = max(16, triton.next_power_of_2(d))
    if invariant:
        block_m = block_n = INVARIANT_BLOCK
    else:
        block_m = 64 if max_len > 32 else 32 if max_len > 16 else 16
        block_n = 64 if max_len > 32 else 32 if max_len > 16 else 16
    grid = (triton.cdiv(max_len, block_m), batch * heads)
    _varlen_attn[grid](qkv, out, cu_seqlens, qkv.stride(0), out.stride(0), (d ** -0.5) * 1.4426950408889634,
                       HEADS=heads, D=d, HID=hid, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                       num_warps=4 if block_m >= 64 else 2, num_stages=2)
    return out
