"""Fused elementwise kernels of the Llama / Qwen2 decoder layer (Triton).

A decode step at batch 64 is a few hundred microseconds of GEMMs and, done with
plain torch ops, about forty small kernels per layer (RMSNorm alone is seven,
RoPE a dozen, the K/V cache write two). Inside a CUDA graph each still costs a
few microseconds, so these three kernels take a layer down to nine launches:

* `add_rmsnorm`: residual += delta (rounded to the activation dtype, as the
  unfused model adds), then RMSNorm of the new residual times the weight;
* `rope_and_cache`: RoPE of q and k straight out of the fused QKV GEMM's output,
  q to its own buffer, k and v into their paged-cache slots;
* `silu_mul`: SiLU(gate) * up from the fused gate/up GEMM's output.

Each also takes its GEMM's output as split-K partial sums (kernels/splitk_gemm.py: FP32
[splits, T, N]); it sums them in split order and rounds to the activation dtype (plus the bias, for
qkv) exactly where the BF16 GEMM output would have been rounded, so the reduction costs no launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from surge.engines.kernels.fp8_rows import fp8_row_codes
from surge.engines.kernels.pdl import launch_kw, wait_then_release
from surge.engines.kernels.splitk_gemm import sum_splits
from surge.models.weight_quant import FP8


@triton.jit
def _add_rmsnorm(x_ptr, delta_ptr, w_ptr, out_ptr, q_ptr, s_ptr, H, eps, stride_s, HAS_DELTA: tl.constexpr,
                 SPLITS: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a weight: read before the wait
    wait_then_release(PDL)
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        if SPLITS > 0:  # split-K partials: the GEMM's BF16 output, rounded here
            d = sum_splits(delta_ptr + row * H + offs, stride_s, mask, SPLITS).to(x_ptr.dtype.element_ty)
        else:
            d = tl.load(delta_ptr + row * H + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * H + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / H
    y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    o = (w * y).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * H + offs, o, mask=mask)
    if FP8_OUT:  # the row's FP8 codes for a W8A8 product (fp8_rows.py), from the rounded output
        fp8_row_codes(o.to(tl.float32), mask, q_ptr + row * H + offs, s_ptr + row)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                pdl: bool = False, fp8_out: bool = False):
    """x [T, H] (updated in place with delta when given) -> RMSNorm(x) * weight. delta: [T, H], or
    split-K partials [S, T, H] (FP32). pdl: a programmatic dependent launch (kernels/pdl.py). fp8_out: also
    the output's rows quantized to FP8 for a W8A8 product: (out, (q [T, H] E4M3, scale [T, 1] FP32)), the
    codes and scales of fp8_rows.quantize_rows(out)."""
    t, h = x.shape
    out = torch.empty_like(x)
    q, s = (torch.empty((t, h), device=x.device, dtype=FP8), torch.empty((t, 1), device=x.device,
                                                                         dtype=torch.float32)) if fp8_out else (x, x)
    block = triton.next_power_of_2(h)
    splits = delta.shape[0] if delta is not None and delta.dim() == 3 else 0
    _add_rmsnorm[(t,)](x, delta if delta is not None else x, weight, out, q, s, h, eps, t * h,
                       HAS_DELTA=delta is not None, SPLITS=splits, FP8_OUT=fp8_out, BLOCK=block, PDL=pdl,
                       num_warps=4 if block <= 2048 else 8, **launch_kw(pdl))
    return (out, (q, s)) if fp8_out else out


@triton.jit
def _rope_cache(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, T, stride_t, stride_s,
                NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, SPLITS: tl.constexpr,
                HAS_BIAS: tl.constexpr, BT: tl.constexpr):
    # a program: BT tokens x one head. One token a program (BT = 1) made a prefill of 8,192 tokens
    # 147k programs of 64 elements each: 90 us a layer where the bytes take ~10 (session 16)
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT).to(tl.int64)
    h = tl.program_id(1)
    tmask = t < T
    offs = tl.arange(0, HALF)
    m2 = tmask[:, None] & (offs[None, :] < HALF)
    base = qkv_ptr + t[:, None] * stride_t + h * D + offs[None, :]
    if SPLITS > 0:  # split-K partials: sum, bias, one rounding, as the BF16 GEMM's epilogue does
        x1 = sum_splits(base, stride_s, m2, SPLITS)
        x2 = sum_splits(base + HALF, stride_s, m2, SPLITS)
        if HAS_BIAS:
            x1 += tl.load(bias_ptr + h * D + offs).to(tl.float32)[None, :]
            x2 += tl.load(bias_ptr + h * D + HALF + offs).to(tl.float32)[None, :]
        x1 = x1.to(q_ptr.dtype.element_ty)
        x2 = x2.to(q_ptr.dtype.element_ty)
    else:
        x1 = tl.load(base, mask=m2, other=0.0)
        x2 = tl.load(base + HALF, mask=m2, other=0.0)
    if h < NQ + NKV:
        pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
        c = tl.load(cos_ptr + pos[:, None] * D + offs[None, :], mask=m2, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * D + offs[None, :], mask=m2, other=0.0).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1 = a * c - b * s
        o2 = b * c + a * s
        if h < NQ:
            dst = q_ptr + t[:, None] * (NQ * D) + h * D + offs[None, :]
        else:
            slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
            dst = k_ptr + slot[:, None] * (NKV * D) + (h - NQ) * D + offs[None, :]
        tl.store(dst, o1.to(q_ptr.dtype.element_ty), mask=m2)
        tl.store(dst + HALF, o2.to(q_ptr.dtype.element_ty), mask=m2)
    else:
        slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
        dst = v_ptr + slot[:, None] * (NKV * D) + (h - NQ - NKV) * D + offs[None, :]
        tl.store(dst, x1, mask=m2)
        tl.store(dst + HALF, x2, mask=m2)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, nq: int, nkv: int,
                   d: int, bias: torch.Tensor | None = None, block_t: int | None = None) -> torch.Tensor:
    """qkv [T, (nq + 2 nkv) d]; cos/sin [max_pos, d]; caches [blocks, page, nkv, d] -> q [T, nq, d].
    qkv may be split-K partials [S, T, (nq + 2 nkv) d] (FP32), with the GEMM's `bias` still to add.
    block_t: tokens a program (a power of two; default 1 below 256 tokens, else 16); the results do
    not depend on it."""
    splits = qkv.shape[0] if qkv.dim() == 3 else 0
    t = qkv.shape[-2]
    q = torch.empty((t, nq, d), device=qkv.device, dtype=k_cache.dtype)
    bt = block_t or (1 if t < 256 else 16)
    _rope_cache[(triton.cdiv(t, bt), nq + 2 * nkv)](
        qkv, bias if bias is not None else qkv, cos, sin, positions, slots, q, k_cache, v_cache, t, qkv.stride(-2),
        qkv.stride(0) if splits else 0, NQ=nq, NKV=nkv, D=d, HALF=d // 2, SPLITS=splits,
        HAS_BIAS=splits > 0 and bias is not None, BT=bt, num_warps=1 if bt == 1 else 4)
    return q


@triton.jit
def _silu_mul(x_ptr, out_ptr, N, I, stride_s, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = offs // I
    col = offs % I
    if SPLITS > 0:  # split-K partials: the GEMM's BF16 output, rounded here
        g = sum_splits(x_ptr + row * (2 * I) + col, stride_s, mask, SPLITS).to(out_ptr.dtype.element_ty)
        g = g.to(tl.float32)
        u = sum_splits(x_ptr + row * (2 * I) + I + col, stride_s, mask, SPLITS).to(out_ptr.dtype.element_ty)
    else:
        g = tl.load(x_ptr + row * (2 * I) + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * (2 * I) + I + col, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out_ptr + offs, act * u, mask=mask)


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype | None = None, pdl: bool = False) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> SiLU(gate) * up [T, I]. gate_up may be split-K partials [S, T, 2I]
    (FP32); the output is then in `dtype` (the activations'). pdl: as add_rmsnorm's."""
    splits = gate_up.shape[0] if gate_up.dim() == 3 else 0
    t, two_i = gate_up.shape[-2:]
    i = two_i // 2
    out = torch.empty((t, i), device=gate_up.device, dtype=dtype or gate_up.dtype)
    n = t * i
    _silu_mul[(triton.cdiv(n, 1024),)](gate_up, out, n, i, t * two_i, SPLITS=splits, BLOCK=1024, PDL=pdl,
                                         num_warps=4, **launch_kw(pdl))
    return out


@triton.jit
def _argmax_part(x_ptr, val_ptr, idx_ptr, V, stride, CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    v, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * CHUNKS + c, v)
    tl.store(idx_ptr + row * CHUNKS + c, c * BLOCK + i)


@triton.jit
def _argmax_final(val_ptr, idx_ptr, out_ptr, CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < CHUNKS
    v = tl.load(val_ptr + row * CHUNKS + offs, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * CHUNKS + offs, mask=mask, other=0)
    _, at = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
    best = tl.sum(tl.where(offs == at, i, 0), 0)
    tl.store(out_ptr + row, best.to(tl.int64))


def argmax_rows(x: torch.Tensor, block: int = 4096, pdl: bool = False) -> torch.Tensor:
    """x [B, V] -> the first index of each row's maximum [B] (int64), as torch.argmax(x, -1) for
    rows without NaN. Two passes: the row split into `block`-wide chunks over the whole chip, then
    the chunks' winners per row (torch's reduction of a few long rows keeps few SMs streaming)."""
    b, v = x.shape
    chunks = triton.cdiv(v, block)
    vals = torch.empty((b, chunks), device=x.device, dtype=torch.float32)
    idx = torch.empty((b, chunks), device=x.device, dtype=torch.int32)
    out = torch.empty(b, device=x.device, dtype=torch.long)
    _argmax_part[(b, chunks)](x, vals, idx, v, x.stride(0), chunks, BLOCK=block, PDL=pdl, num_warps=8,
                              **launch_kw(pdl))
    _argmax_final[(b,)](vals, idx, out, chunks, BLOCK=max(16, triton.next_power_of_2(chunks)), PDL=pdl,
                        num_warps=1, **launch_kw(pdl))
    return out
