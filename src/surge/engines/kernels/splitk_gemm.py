"""Split-K GEMM for the decode step's skinny products: a[M, K] @ w[N, K]^T with M <= 64 (Triton).

At M = 64 cuBLAS covers Qwen2-0.5B's narrow products (o and down: N = 896, qkv: N = 1152) with 7-9
output tiles, so 7-9 of the H200's 132 SMs stream the weights and the GEMM runs far under memory
bandwidth. Here K is cut into `splits` ranges as well: tiles x splits programs share the weight
stream, each writes its FP32 partial sums to a workspace [splits, M, N], and whoever reads the product
sums the splits in split order: `reduce_partials` here, or the decoder's fused kernels
(kernels/decoder_fused.py), which read the workspace directly and so cost no extra launch.

Deterministic and batch-invariant by construction: no atomics; the splits are summed in a fixed
order; a row's partial sums depend on that row alone (every launch tiles M by the same BLOCK_M rows,
so the same MMA instructions compute it whether it is alone or one of 64); and the plan (tiles, split
count) is looked up by (N, K) only, never by M or by who is in the batch.
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
from surge.engines.kernels.tile_mma import mma

BLOCK_M = 64  # rows of every program: one M tile holds a whole decode batch (the weights are read once)
MAX_M = 64  # the engine uses split-K up to this many rows (measured at M = 64; cuBLAS above)
# 8-bit weights: the kernel up to this many rows, above it cuBLAS on the weight dequantized for the call
# (kernels/dequant.py). Qwen2-0.5B's four GEMMs on FP8, H100, session 37 (benchmarks/gpu_q8_rows.py, us a layer,
# kernel / dequant + cuBLAS): M = 64 38.6 / 40.5, 96 52.2 / 42.1, 128 53.0 / 43.6, 256 81.7 / 49.2, 512 149.1 / 60.4
# (the kernel's M tiles each read the whole weight); INT8 the same within 2 us.
Q8_MAX_M = 64


@dataclass(frozen=True)
class SplitKPlan:
    block_n: int
    block_k: int
    splits: int  # asked for; `num_splits(k)` is what runs once K is cut into whole BLOCK_K steps
    num_warps: int = 4
    num_stages: int = 2
    swap: bool = False  # the product as w @ a^T: N on the MMA's long side, the batch on its short side
    tma: bool = False  # operands read by TMA (kernels/tma.py) where the tensors allow it; same sums, bit for bit

    def k_split(self, k: int) -> int:
        return triton.cdiv(triton.cdiv(k, self.splits), self.block_k) * self.block_k

    def num_splits(self, k: int) -> int:
        return triton.cdiv(k, self.k_split(k))


# Measured on one H200 (torch 2.11, Triton 3.6) by benchmarks/gpu_splitk_tune.py, M = 64, 24 layers'
# distinct weights in one CUDA graph, each GEMM timed with the kernel that reads its output
# (docs/benchmarks/generate.md, session 8). A shape missing here, or one where cuBLAS won, stays on cuBLAS.
# Session 8, call 2 (GEMM + its reader, us, cuBLAS -> split-K): qkv 6.46 -> 5.70, o 6.04 -> 5.01, down
# 10.20 -> 8.48 (call 1 within 0.1 us of these); up_gate stays on cuBLAS (9.57 against 10.27 at best).
POINTER_PLANS: dict[tuple[int, int], SplitKPlan] = {
    (1152, 896): SplitKPlan(64, 128, 7, num_warps=4, num_stages=2, swap=True),
    (896, 896): SplitKPlan(32, 256, 4, num_warps=4, num_stages=1),
    (896, 4864): SplitKPlan(32, 256, 4, num_warps=4, num_stages=3),
}

# Session 18 (benchmarks/gpu_tma_gemm.py, call 1, same timing; the partials equal the pointer plans' bit
# for bit, same split counts): down 6.63 -> 5.54 us, o 3.50 -> 3.28; qkv 3.70 -> 3.62 at best, inside the
# noise, so qkv keeps its pointer plan.
# Session 20, Llama-1B's shapes (benchmarks/gpu_splitk_tune.py --shape llama-1b --tma, 16 layers' weights,
# GEMM + its reader, us, cuBLAS -> split-K): qkv 10.04 -> 9.44, o 8.11 -> 7.29, down 16.33 -> 14.11 (the
# partials alone 6.90 -> 6.29, 6.45 -> 5.26, 14.39 -> 11.78); up_gate stays on cuBLAS (21.81 against 22.76).
# With kernels/gate_up.py's plan the decode graph went 1,334 -> 1,239 us (generate_ab, docs/benchmarks/s20).
PLANS: dict[tuple[int, int], SplitKPlan] = {
    **POINTER_PLANS,
    (896, 896): SplitKPlan(32, 128, 4, num_warps=4, num_stages=3, tma=True),
    (896, 4864): SplitKPlan(32, 256, 4, num_warps=4, num_stages=4, tma=True),
    (3072, 2048): SplitKPlan(32, 128, 4, num_warps=4, num_stages=3, tma=True),
    (2048, 2048): SplitKPlan(32, 128, 4, num_warps=4, num_stages=4, tma=True),
    (2048, 8192): SplitKPlan(64, 256, 4, num_warps=4, num_stages=3, swap=True, tma=True),
}


# 8-bit weights (FP8 / INT8, models/weight_quant.py): cuBLAS has no product of BF16 activations with them, so every
# shape runs here; a shape missing from this table takes its BF16 plan, else default_plan (to be measured by
# benchmarks/gpu_q8_tune.py).
# Qwen2-0.5B's qkv: its BF16 pointer plan compiled for INT8 weights spills (255 registers, 40 bytes of stack,
# benchmarks/q8_compile_check.py --weights int8, docs/benchmarks/s35); the same tiles by TMA do not (118), and in
# BF16 the two were within noise (session 18: 3.70 against 3.62 us). Not yet timed on 8-bit weights.
Q8_PLANS: dict[tuple[int, int], SplitKPlan] = {
    # Qwen2-0.5B, measured on FP8 weights (H100, session 36: benchmarks/gpu_q8_tune.py --quick; INT8 runs them
    # unmeasured): us a layer at M = 64, BF16's plan on BF16 weights / BF16's plan on FP8 / this plan on FP8
    (1152, 896): SplitKPlan(64, 128, 7, num_warps=4, num_stages=2, swap=True, tma=True),  # 4.02 / 4.31 / 4.31
    (896, 896): SplitKPlan(64, 128, 7, num_warps=4, num_stages=1, swap=False, tma=False),  # 3.44 / 4.07 / 3.87
    (896, 4864): SplitKPlan(32, 128, 14, num_warps=4, num_stages=3, swap=False, tma=True),  # 6.08 / 8.03 / 6.35
}


def plan_for(n: int, k: int) -> SplitKPlan | None:
    """The measured plan of a [N, K] weight, or None (cuBLAS)."""
    return PLANS.get((n, k))


def q8_plan_for(n: int, k: int) -> SplitKPlan:
    """The plan of a [N, K] 8-bit weight: measured for 8-bit weights, else the BF16 one, else default_plan."""
    return Q8_PLANS.get((n, k)) or PLANS.get((n, k)) or default_plan(n, k)


def default_plan(n: int, k: int) -> SplitKPlan:
    """A plan for any (N, K), from (N, K) alone (used where no measurement exists and split-K is
    asked for anyway, e.g. tests on small models): ~2 programs per SM of 132, 64-wide tiles."""
    block_k = 128 if k >= 512 else 64
    tiles = triton.cdiv(n, 64)
    splits = max(1, min(triton.cdiv(k, block_k), round(264 / tiles)))
    return SplitKPlan(64, block_k, splits, num_stages=3)


@triton.jit
def _prefetch_slice(w_ptr, offs_n, N, K, k0, stride_wn, K_SPLIT: tl.constexpr, LINES: tl.constexpr):
    """The program's weight slice (its rows, K from k0 on, K_SPLIT long) into L2, 128-byte lines (PDL)."""
    size = w_ptr.dtype.element_ty.primitive_bitwidth // 8  # bytes a weight: 2, or 1 for 8-bit weights
    row_bytes = (tl.minimum(K - k0, K_SPLIT) * size).to(tl.int64)
    line = tl.minimum(tl.arange(0, LINES).to(tl.int64) * 128, row_bytes - 1)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    prefetch_l2((w_ptr + k0).to(tl.pointer_type(tl.int8)) + rows[:, None] * stride_wn * size + line[None, :])


@triton.jit
def scale_columns(acc, scale_ptr, offs_n, n_ok, SWAP: tl.constexpr):
    """An 8-bit weight's per-row scales (models/weight_quant.py) applied to the tile's FP32 sums: N runs down a
    swapped tile, across a plain one."""
    sc = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    if SWAP:
        out = acc * sc[:, None]
    else:
        out = acc * sc[None, :]
    return out


@triton.jit
def _store_partials(acc, ws_ptr, pid_s, M, N, offs_m, offs_n, SWAP: tl.constexpr):
    """A program's FP32 partial sums into split pid_s of the [S, M, N] workspace (tiles transposed with SWAP)."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    ws = ws_ptr + pid_s.to(tl.int64) * M * N
    if SWAP:
        tl.store(ws + offs_m[None, :].to(tl.int64) * N + offs_n[:, None], acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(ws + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _partials(a_ptr, w_ptr, ws_ptr, M, N, K, stride_am, stride_wn, scale_ptr, la_ptr, lb_ptr, slot_ptr, R, W,
              stride_la, stride_lb, W_SCALE: tl.constexpr, K_SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
              SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
              LINES: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_s * K_SPLIT + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # LoRA (kernels/lora_delta.py): the rows' slots (step metadata) and B's rows (weights) before the wait
    slot = row_slots(slot_ptr, offs_m, m_ok, LORA)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    if LORA:
        b = lora_b(lb_ptr, stride_lb, offs_n, n_ok, offs_r, r_ok)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PDL and K_SPLIT == BLOCK_K:
        # one K step: the program's whole weight tile is read while the predecessor still runs
        k_ok = offs_k < K
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if LORA:
            la = lora_a(la_ptr, stride_la, offs_r, r_ok, offs_k, k_ok)
        wait_then_release(PDL)
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = mma(a, w, acc, SWAP)
        if LORA:
            t = tl.dot(a, tl.trans(la), t)
    else:
        if PDL:  # several K steps: the weight slice's 128-byte lines into L2 before the wait
            _prefetch_slice(w_ptr, offs_n, N, K, pid_s * K_SPLIT, stride_wn, K_SPLIT, LINES)
        wait_then_release(PDL)
        for i in range(0, K_SPLIT // BLOCK_K):
            k_ok = offs_k < K - i * BLOCK_K
            if EVEN_K:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = mma(a, w, acc, SWAP)
            if LORA:
                t = tl.dot(a, tl.trans(lora_a(la_ptr, stride_la, offs_r, r_ok, offs_k + i * BLOCK_K, k_ok)), t)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if W_SCALE:  # 8-bit weights: the sums scaled before anything joins them
        acc = scale_columns(acc, scale_ptr, offs_n, n_ok, SWAP)
    if LORA:  # this split's share of the rows' deltas (its K range), into its partial sums
        acc, _ = join_deltas(acc, acc, t, b, b, slot, offs_r, R, W, False, SWAP)
    _store_partials(acc, ws_ptr, pid_s, M, N, offs_m, offs_n, SWAP)


@triton.jit(do_not_specialize=["M"])
def _partials_tma(a_desc, w_desc, w_ptr, ws_ptr, M, N, K, stride_wn, scale_ptr, la_desc, la_ptr, lb_ptr, slot_ptr,
                  R, W, stride_la, stride_lb, W_SCALE: tl.constexpr, K_SPLIT: tl.constexpr, SWAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, LINES: tl.constexpr,
                  LORA: tl.constexpr, BLOCK_R: tl.constexpr, LA_TMA: tl.constexpr):
    """_partials with both operands read by TMA: tiles past M, N or K arrive as zeros, as the pointer
    kernel's masks load them, so the sums are the same bit for bit (A's LoRA tiles too with LA_TMA, else
    by pointer, masked)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    k0 = pid_s * K_SPLIT
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    slot = row_slots(slot_ptr, offs_m, offs_m < M, LORA)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    if LORA:
        b = lora_b(lb_ptr, stride_lb, offs_n, offs_n < N, offs_r, r_ok)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if PDL:  # the weight slice's lines into L2 before the wait, as _partials asks for them
        _prefetch_slice(w_ptr, offs_n, N, K, k0, stride_wn, K_SPLIT, LINES)
    wait_then_release(PDL)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, K_SPLIT // BLOCK_K):
        a = a_desc.load([m0, k0 + i * BLOCK_K])
        w = w_desc.load([n0, k0 + i * BLOCK_K])
        acc = mma(a, w, acc, SWAP)
        if LORA:
            if LA_TMA:
                la = la_desc.load([0, k0 + i * BLOCK_K])
            else:
                offs_k = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
                la = lora_a(la_ptr, stride_la, offs_r, r_ok, offs_k, offs_k < K)
            t = tl.dot(a, tl.trans(la), t)
    if W_SCALE:
        acc = scale_columns(acc, scale_ptr, offs_n, offs_n < N, SWAP)
    if LORA:
        acc, _ = join_deltas(acc, acc, t, b, b, slot, offs_r, R, W, False, SWAP)
    _store_partials(acc, ws_ptr, pid_s, M, N, offs_m, offs_n, SWAP)


@triton.jit
def sum_splits(ptr, stride_s, mask, SPLITS: tl.constexpr):
    """The FP32 sum of SPLITS partials at ptr, ptr + stride_s, ... in split order (for fused readers)."""
    acc = tl.load(ptr, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(ptr + s * stride_s, mask=mask, other=0.0)
    return acc


@triton.jit
def _reduce(ws_ptr, bias_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = sum_splits(ws_ptr + offs, MN, mask, SPLITS)
    if HAS_BIAS:  # after the whole sum, as cuBLAS's epilogue adds it
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def partials(a: torch.Tensor, w: torch.Tensor, plan: SplitKPlan, out: torch.Tensor | None = None,
             pdl: bool = False, lora: LoraOperands | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K], w [N, K] (BF16 / FP16) -> FP32 partial products [plan.num_splits(K), M, N].
    A plan with `tma` reads both through TMA where kernels/tma.usable allows (else pointer loads: the
    same partials bit for bit). pdl: launched with programmatic dependent launch, the weights read (one
    K step) or prefetched into L2 (several) before waiting for the kernel that wrote `a` (kernels/pdl.py).
    lora: the rows' LoRA deltas joined in the same kernel, each split adding the share of its K range
    (kernels/lora_delta.py: x A^T summed in the same K loop, joined after it); the partials then sum to the
    product plus each row's own adapter's delta. A plan's pipeline depth may drop where A's tiles need the
    shared memory (lora_delta.join_stages). scale [N] FP32: w is an 8-bit weight (FP8 E4M3 or INT8,
    models/weight_quant.py) whose row n stands for w[n] * scale[n]: its tiles are converted to a's dtype (exactly)
    for the products, and each split's sums are scaled before the LoRA deltas join them."""
    m, k = a.shape
    n = w.shape[0]
    if a.stride(1) != 1:
        a = a.contiguous()
    w_scale = check_scale(w, scale)
    lkw = lora_args(lora, a, n, w)
    stages = join_stages(plan.num_stages, plan.block_k, BLOCK_M + plan.block_n, lora)
    ks = plan.k_split(k)
    s = triton.cdiv(k, ks)
    if out is None:
        out = torch.empty((s, m, n), device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(n, plan.block_n), s, triton.cdiv(m, BLOCK_M))
    lines = triton.next_power_of_2(triton.cdiv(ks * w.element_size(), 128))
    if plan.tma and tma.usable(a, w):
        w_desc = tma.descriptor(w, (plan.block_n, plan.block_k))
        la_desc, la_tma = a_descriptor(lora, plan.block_k, w_desc)
        _partials_tma[grid](tma.descriptor(a, (BLOCK_M, plan.block_k)), w_desc, w, out, m, n, k, w.stride(0),
                            w_scale, la_desc, *lkw["args"], W_SCALE=scale is not None, K_SPLIT=ks, SWAP=plan.swap,
                            BLOCK_M=BLOCK_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, PDL=pdl, LINES=lines,
                            **lkw["constexprs"], LA_TMA=la_tma, num_warps=plan.num_warps, num_stages=stages,
                            **launch_kw(pdl))
        return out
    _partials[grid](a, w, out, m, n, k, a.stride(0), w.stride(0), w_scale, *lkw["args"], W_SCALE=scale is not None,
                    K_SPLIT=ks, EVEN_K=k % ks == 0,
                    SWAP=plan.swap, BLOCK_M=BLOCK_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, PDL=pdl,
                    LINES=lines, **lkw["constexprs"], num_warps=plan.num_warps, num_stages=stages,
                    **launch_kw(pdl))
    return out


def check_scale(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The scale argument of a kernel that takes an 8-bit weight (a placeholder without one), checked."""
    eight = w.dtype in (torch.float8_e4m3fn, torch.int8)
    if scale is None:
        if eight:
            raise ValueError(f"an 8-bit ({w.dtype}) weight needs its per-row scales")
        return w
    if not eight or scale.dtype != torch.float32 or scale.shape != (w.shape[0],) or not scale.is_contiguous():
        raise ValueError(f"scale must be [{w.shape[0]}] FP32 for a float8_e4m3fn or int8 weight, not "
                         f"{list(scale.shape)} {scale.dtype} for {w.dtype}")
    return scale


def reduce_partials(ws: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
                    ) -> torch.Tensor:
    """[S, M, N] FP32 partials -> [M, N] in `dtype`: the splits summed in order, then the bias, rounded once."""
    s, m, n = ws.shape
    out = torch.empty((m, n), device=ws.device, dtype=dtype)
    block = 1024
    _reduce[(triton.cdiv(m * n, block),)](ws, bias if bias is not None else ws, out, m * n, n, SPLITS=s,
                                          HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def linear(a: torch.Tensor, w: torch.Tensor, plan: SplitKPlan, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(a, w, bias) through split-K: two launches (the decoder fuses the second away). With an 8-bit
    w and its scales: F.linear(a, w * scale[:, None], bias) with the scales applied to the FP32 sums."""
    return reduce_partials(partials(a, w, plan, scale=scale), bias, a.dtype)
