"""The SwiGLU MLP's first half in one kernel: SiLU(x @ W_gate^T) * (x @ W_up^T) (Triton).

In the decode step the fused gate/up product (N = 2 x 4864 for Qwen2-0.5B) ran on cuBLAS and a
second kernel (`decoder_fused.silu_mul`) read its BF16 output back to apply SiLU(gate) * up. Here a
program computes a BLOCK_N-wide slice of both halves (W's gate rows [n, n + BLOCK_N) and up rows
[I + n, I + n + BLOCK_N)) and applies the product in its epilogue: one launch instead of two, and,
being Triton, it takes part in programmatic dependent launch (its weight slice is prefetched into L2
while the previous kernel runs; kernels/pdl.py), which the cuBLAS kernel could not.

Rounding as the two-kernel path rounds: each product is rounded to the activation dtype (the GEMM's
BF16 output), then SiLU in FP32 rounded again, times up, as `silu_mul` computes it. The full K is
summed by one program in a fixed order, and every launch tiles M by the same BLOCK_M rows, so a row's
result does not depend on the other rows of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.engines.kernels import tma
from surge.engines.kernels.lora_delta import (LoraOperands, a_descriptor, join_deltas, join_stages, lora_a, lora_args,
                                              lora_b, row_slots)
from surge.engines.kernels.pdl import launch_kw, prefetch_l2, wait_then_release
from surge.engines.kernels.splitk_gemm import check_scale, scale_columns
from surge.engines.kernels.tile_mma import mma

BLOCK_M = 64  # one M tile holds a whole decode batch: the weights are read once
MAX_M = 64


@dataclass(frozen=True)
class GateUpPlan:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False  # W @ x^T: the weight rows on the MMA's long side, the batch on its short side
    tma: bool = False  # x and W read by TMA (kernels/tma.py) where the tensors allow it; same bits


# Measured on one H200 (torch 2.11, Triton 3.6) by benchmarks/gpu_gate_up_tune.py at M = 64, 24 layers'
# distinct weights in one CUDA graph, each candidate timed in the layer's chain (add_rmsnorm -> this ->
# the down GEMM) against cuBLAS + silu_mul (docs/benchmarks/generate.md, session 10). A shape missing
# here stays on cuBLAS + silu_mul. Session 10, call 2 (us a layer of that chain, PDL on): cuBLAS + silu_mul
# 17.42 (18.46 without PDL), this plan 16.26; alone (no chain, no PDL) 9.32 against cuBLAS + silu_mul's 9.75.
POINTER_PLANS: dict[tuple[int, int], GateUpPlan] = {
    (4864, 896): GateUpPlan(32, 128, num_warps=4, num_stages=3),
}

# Session 18 (benchmarks/gpu_tma_gemm.py, call 1, alone as above, no PDL): 9.36 -> 7.87 us, the output
# equal to the pointer plan's bit for bit; the MLP chain with the TMA down GEMM (kernels/splitk_gemm.py):
# 16.24 -> 15.29 us a layer with PDL, 17.96 -> 15.64 without.
# Session 20, Llama-1B's MLP (I = 8192, K = 2048; benchmarks/gpu_gate_up_tune.py --shape llama-1b --tma,
# 16 layers): alone 19.38 us against cuBLAS + silu_mul's 21.92; the MLP chain with the split-K down
# 34.14 us a layer against 36.46 without PDL (with PDL 36.8 against 37.5: the prefetch of a 67 MB weight
# does not pay); in the engine's decode graph 1,334 -> 1,239 us with the split-K plans (generate_ab).
PLANS: dict[tuple[int, int], GateUpPlan] = {
    (4864, 896): GateUpPlan(64, 128, num_warps=4, num_stages=4, tma=True),
    (8192, 2048): GateUpPlan(32, 128, num_warps=4, num_stages=3, tma=True),
}


def plan_for(i: int, k: int) -> GateUpPlan | None:
    """The measured plan of an MLP with intermediate size i and hidden size k, or None (cuBLAS)."""
    return PLANS.get((i, k))


def default_plan(i: int, k: int) -> GateUpPlan:
    """A plan from the shape alone (tests, unmeasured shapes asked for explicitly)."""
    return GateUpPlan(32 if i >= 2048 else 16, 128 if k >= 128 else 64)


# 8-bit weights (FP8 / INT8, models/weight_quant.py): every shape runs here (cuBLAS has no BF16 x 8-bit product); a
# shape missing from this table takes its BF16 plan, else default_plan.
Q8_PLANS: dict[tuple[int, int], GateUpPlan] = {
    # Qwen2-0.5B on FP8 weights (H100, session 36, benchmarks/gpu_q8_tune.py --quick): 9.43 us a layer for BF16's
    # plan on BF16 weights, 15.10 for it on FP8, 12.72 for this one
    (4864, 896): GateUpPlan(32, 128, num_warps=4, num_stages=3, swap=False, tma=False),
}


def q8_plan_for(i: int, k: int) -> GateUpPlan:
    """The plan of an MLP with 8-bit weights: measured for 8-bit weights, else the BF16 one, else default_plan."""
    return Q8_PLANS.get((i, k)) or PLANS.get((i, k)) or default_plan(i, k)


@triton.jit
def _prefetch_gate_up_rows(w_ptr, offs_n, I, K, stride_wn, LINES: tl.constexpr):
    """The program's gate and up rows (whole K) into L2 while the previous kernel runs (PDL)."""
    size = w_ptr.dtype.element_ty.primitive_bitwidth // 8  # bytes a weight: 2, or 1 for 8-bit weights
    line = tl.minimum(tl.arange(0, LINES).to(tl.int64) * 128, K.to(tl.int64) * size - 1)
    rows = tl.minimum(offs_n, I - 1).to(tl.int64)
    base = w_ptr.to(tl.pointer_type(tl.int8)) + rows[:, None] * stride_wn * size + line[None, :]
    prefetch_l2(base)
    prefetch_l2(base + I.to(tl.int64) * stride_wn * size)


@triton.jit
def _scaled_halves(acc_g, acc_u, scale_ptr, offs_n, n_ok, I, SWAP: tl.constexpr):
    """An 8-bit weight's scales (gate rows, then up rows I further) applied to the two halves' FP32 sums."""
    return (scale_columns(acc_g, scale_ptr, offs_n, n_ok, SWAP),
            scale_columns(acc_u, scale_ptr + I, offs_n, n_ok, SWAP))


@triton.jit
def _silu_mul_store(acc_g, acc_u, out_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, SWAP: tl.constexpr):
    """silu_mul's arithmetic on the GEMM's rounded outputs, stored [M, I] (tiles transposed with SWAP)."""
    dt = out_ptr.dtype.element_ty
    gf = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt)
    y = (gf / (1.0 + tl.exp(-gf))).to(dt) * up
    if SWAP:
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None], y,
                 mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y,
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _gate_up(a_ptr, w_ptr, out_ptr, M, I, K, stride_am, stride_wn, stride_om, scale_ptr, la_ptr, lb_ptr, slot_ptr, R,
             W, stride_la, stride_lb, W_SCALE: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr,
             LORA: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < I
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    g_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I.to(tl.int64) * stride_wn
    # LoRA (kernels/lora_delta.py): the rows' slots (step metadata) and B's gate and up rows before the wait
    slot = row_slots(slot_ptr, offs_m, m_ok, LORA)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    if LORA:
        bg = lora_b(lb_ptr, stride_lb, offs_n, n_ok, offs_r, r_ok)
        bu = lora_b(lb_ptr, stride_lb, I + offs_n, n_ok, offs_r, r_ok)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if PDL:
        _prefetch_gate_up_rows(w_ptr, offs_n, I, K, stride_wn, LINES)
    wait_then_release(PDL)
    if SWAP:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - i * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g = mma(a, g, acc_g, SWAP)
        acc_u = mma(a, u, acc_u, SWAP)
        if LORA:
            t = tl.dot(a, tl.trans(lora_a(la_ptr, stride_la, offs_r, r_ok, offs_k + i * BLOCK_K, k_ok)), t)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if W_SCALE:  # 8-bit weights: each half's sums scaled before the deltas join them
        acc_g, acc_u = _scaled_halves(acc_g, acc_u, scale_ptr, offs_n, n_ok, I, SWAP)
    if LORA:  # the deltas join each half's FP32 sum, rounded with it
        acc_g, acc_u = join_deltas(acc_g, acc_u, t, bg, bu, slot, offs_r, R, W, True, SWAP)
    _silu_mul_store(acc_g, acc_u, out_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, SWAP)


@triton.jit(do_not_specialize=["M"])
def _gate_up_tma(a_desc, w_desc, w_ptr, out_ptr, M, I, K, stride_wn, stride_om, scale_ptr, la_desc, la_ptr, lb_ptr,
                 slot_ptr, R, W, stride_la, stride_lb, W_SCALE: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr,
                 LORA: tl.constexpr, BLOCK_R: tl.constexpr, LA_TMA: tl.constexpr):
    """_gate_up with x and W read by TMA: tiles past M or K arrive as zeros, as _gate_up's masks load
    them, so the products (and the epilogue) are the same bit for bit. I must be a multiple of BLOCK_N
    (a gate tile must not run into the up rows)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    slot = row_slots(slot_ptr, offs_m, offs_m < M, LORA)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    if LORA:
        bg = lora_b(lb_ptr, stride_lb, offs_n, offs_n < I, offs_r, r_ok)
        bu = lora_b(lb_ptr, stride_lb, I + offs_n, offs_n < I, offs_r, r_ok)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if PDL:
        _prefetch_gate_up_rows(w_ptr, offs_n, I, K, stride_wn, LINES)
    wait_then_release(PDL)
    if SWAP:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([m0, i * BLOCK_K])
        acc_g = mma(a, w_desc.load([n0, i * BLOCK_K]), acc_g, SWAP)
        acc_u = mma(a, w_desc.load([I + n0, i * BLOCK_K]), acc_u, SWAP)
        if LORA:
            if LA_TMA:
                la = la_desc.load([0, i * BLOCK_K])
            else:
                offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
                la = lora_a(la_ptr, stride_la, offs_r, r_ok, offs_k, offs_k < K)
            t = tl.dot(a, tl.trans(la), t)
    if W_SCALE:
        acc_g, acc_u = _scaled_halves(acc_g, acc_u, scale_ptr, offs_n, offs_n < I, I, SWAP)
    if LORA:
        acc_g, acc_u = join_deltas(acc_g, acc_u, t, bg, bu, slot, offs_r, R, W, True, SWAP)
    _silu_mul_store(acc_g, acc_u, out_ptr, offs_m, offs_n, offs_m < M, offs_n < I, stride_om, SWAP)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, plan: GateUpPlan, pdl: bool = False,
                 lora: LoraOperands | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w [2I, K] (gate rows, then up rows; BF16 / FP16) -> SiLU(x @ W_gate^T) * (x @ W_up^T)
    [M, I], as F.linear followed by decoder_fused.silu_mul would give up to the GEMMs' summation order.
    A plan with `tma` reads x and W through TMA where kernels/tma.usable allows and I is a multiple of its
    BLOCK_N (else pointer loads: the same bits). pdl: a programmatic dependent launch, the weights
    prefetched into L2 before the wait. lora: the rows' LoRA deltas of the fused gate/up module (b [2I, R]),
    joined to each half's FP32 sum before the SiLU in the same kernel (kernels/lora_delta.py; the plan's
    pipeline depth may drop: lora_delta.join_stages). scale [2I] FP32: w is an 8-bit weight (models/weight_quant.py),
    each half's sums scaled by its rows' scales before the deltas and the SiLU."""
    m, k = x.shape
    two_i = w.shape[0]
    if two_i % 2 or w.shape[1] != k:
        raise ValueError(f"w must be [2I, {k}], not {list(w.shape)}")
    if w.stride(1) != 1:
        raise ValueError("w's rows must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    i = two_i // 2
    w_scale = check_scale(w, scale)
    lkw = lora_args(lora, x, two_i, w)
    stages = join_stages(plan.num_stages, plan.block_k, BLOCK_M + 2 * plan.block_n, lora)
    out = torch.empty((m, i), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(i, plan.block_n), triton.cdiv(m, BLOCK_M))
    lines = triton.next_power_of_2(triton.cdiv(k * w.element_size(), 128))
    if plan.tma and i % plan.block_n == 0 and tma.usable(x, w):
        w_desc = tma.descriptor(w, (plan.block_n, plan.block_k))
        la_desc, la_tma = a_descriptor(lora, plan.block_k, w_desc)
        _gate_up_tma[grid](tma.descriptor(x, (BLOCK_M, plan.block_k)), w_desc, w, out, m, i, k, w.stride(0),
                           out.stride(0), w_scale, la_desc, *lkw["args"], W_SCALE=scale is not None, SWAP=plan.swap,
                           BLOCK_M=BLOCK_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, PDL=pdl, LINES=lines,
                           **lkw["constexprs"], LA_TMA=la_tma, num_warps=plan.num_warps, num_stages=stages,
                           **launch_kw(pdl))
        return out
    _gate_up[grid](x, w, out, m, i, k, x.stride(0), w.stride(0), out.stride(0), w_scale, *lkw["args"],
                   W_SCALE=scale is not None, EVEN_K=k % plan.block_k == 0, SWAP=plan.swap, BLOCK_M=BLOCK_M,
                   BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, PDL=pdl, LINES=lines, **lkw["constexprs"], num_warps=plan.num_warps,
                   num_stages=stages, **launch_kw(pdl))
    return out
