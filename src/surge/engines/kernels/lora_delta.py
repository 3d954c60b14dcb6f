"""A module's LoRA deltas added to its product in two kernels: out += ((x A^T) * mask) B^T (Triton).

The torch form of engines/decoder/lora.py runs a module's deltas as five kernels (x A^T, the mask,
its product, (.) B^T, the add): ~480 launches a decode step for Qwen2-0.5B's 24 layers x 4 modules,
and its x A^T is a GEMM of 64 x (slots x rank) outputs over K = 896-4864 that cuBLAS gives one or
two CTAs. Adapter rows cost 2.2x the step on an H200 (docs/benchmarks/generate.md, session 31).
One kernel a module, each program recomputing x A^T for its slice of the output, measured slower
still (session 32: its programs each walk all of K alone). Here, as punica / vLLM's LoRA kernels do:

* shrink: (rank chunk, K split) programs each write the FP32 partial x A^T of their K range to a
  workspace [splits, M, R] (no atomics);
* expand: a program owns a BLOCK_N-wide slice of the output: it sums the partials in split order,
  rounds, zeroes each row's columns of other slots (the mask built from the rows' slots in the
  kernel), multiplies by its slice of B and adds the result to `out` in place.

A chunk of the stacked rank that no row of the tile reads (a slot no row of this step uses) is
skipped by both: its contribution is exact zeros, so skipping changes no bit, and a step whose rows
use one adapter of four pays for one. Rounding as the torch form rounds: x A^T rounded to the
activation dtype, the masked product summed in FP32 and rounded to it, then added to `out` in FP32
(a BF16 `out` rounded once more; a split-K partial in FP32 takes it exactly). A row's delta depends
on that row alone (other rows' columns are zeros, the splits are fixed by K alone and summed in
order, the tiles' MMAs compute each row independently), so it does not depend on who shares the batch.

In decode steps the two kernels give way to the join below (LoraOperands, join_deltas): the module's own
split-K / gate-up GEMM kernel sums x A^T in its K loop and adds the masked, rounded product with B to its
sums, for up to JOIN_MAX_R stacked columns (session 34: adapter rows 0.56x -> 0.80x the engine without
slots on an H100). The two kernels stay for prefill chunks, wider banks and steps past the GEMMs' plans.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from surge.engines.kernels.pdl import launch_kw, wait_then_release
from surge.engines.kernels.tile_mma import mma

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 128


class LoraOperands(NamedTuple):
    """A module's stacked slots and the rows' slots, for a GEMM kernel that joins the deltas (join_deltas)."""
    a: torch.Tensor  # [S * width, K]
    b: torch.Tensor  # [N, S * width]
    slots: torch.Tensor  # [M] each row's slot, 0 for none
    width: int


def lora_args(lora: LoraOperands | None, x: torch.Tensor, n: int, dummy: torch.Tensor) -> dict:
    """The LoRA arguments of a GEMM kernel that takes them (la, lb, slots, R, W, their strides; LORA,
    BLOCK_R), checked against the GEMM's x [M, K] and N; without lora, placeholders the kernel never reads."""
    if lora is None:
        return {"args": (dummy, dummy, dummy, 0, 1, 0, 0), "constexprs": {"LORA": False, "BLOCK_R": 16}}
    a, b, slots, width = lora
    m, k = x.shape
    if a.shape[1] != k or b.shape != (n, a.shape[0]) or slots.shape != (m,) or a.shape[0] % width:
        raise ValueError(f"LoRA operands do not fit the GEMM: x {list(x.shape)}, N {n}, a {list(a.shape)}, "
                         f"b {list(b.shape)}, slots {list(slots.shape)}, width {width}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b must have contiguous rows")
    r = a.shape[0]
    if r > JOIN_MAX_R:
        raise ValueError(f"{r} stacked LoRA columns: a GEMM joins at most {JOIN_MAX_R} (the two delta kernels "
                         "take more)")
    return {"args": (a, b, slots, r, width, a.stride(0), b.stride(0)),
            "constexprs": {"LORA": True, "BLOCK_R": join_block_r(r)}}


def join_block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def join_stages(stages: int, block_k: int, tile_rows: int, lora: LoraOperands | None, budget: int = 200 * 1024) -> int:
    """A plan's pipeline depth, less where A's tiles (join_block_r rows a K step) would overflow shared memory:
    tile_rows is what a stage holds already (x's rows plus the weight rows), 16-bit elements."""
    if lora is None:
        return stages
    per_stage = (tile_rows + join_block_r(lora.a.shape[0])) * block_k * 2
    while stages > 1 and stages * per_stage > budget:
        stages -= 1
    return stages


K_SPLIT = 256  # K a shrink program sums: Qwen2-0.5B's K = 896 in 4 splits, 4864 in 19


@triton.jit
def _chunk_hit(slot, offs_r, R, W):
    """[BLOCK_M, BLOCK_R]: the row's slot owns the column; and whether any row owns any column here."""
    hit = (slot[:, None] == (offs_r // W + 1)[None, :]) & (offs_r < R)[None, :]
    return hit, tl.max(tl.max(hit.to(tl.int32), axis=1), axis=0) > 0


@triton.jit(do_not_specialize=["M"])
def _lora_shrink(x_ptr, a_ptr, slot_ptr, ws_ptr, M, K, R, W, stride_xm, stride_am, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, K_SPLIT: tl.constexpr, PDL: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    r_ok = offs_r < R
    # the slots are the step's metadata, written before the step's first kernel: read before the wait
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=0).to(tl.int32)
    wait_then_release(PDL)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    _, any_hit = _chunk_hit(slot, offs_r, R, W)
    if any_hit:
        for k0 in range(pid_s * K_SPLIT, tl.minimum(K, (pid_s + 1) * K_SPLIT), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xk = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            ak = tl.load(a_ptr + offs_r[:, None].to(tl.int64) * stride_am + offs_k[None, :],
                         mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            t = tl.dot(xk, tl.trans(ak), t)
    ws = ws_ptr + (pid_s * M + offs_m[:, None]).to(tl.int64) * R + offs_r[None, :]
    tl.store(ws, t, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _lora_expand(ws_ptr, b_ptr, slot_ptr, out_ptr, M, N, R, W, SPLITS, stride_bn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=0).to(tl.int32)
    wait_then_release(PDL)
    DT = b_ptr.dtype.element_ty  # the activations' dtype (B is stored in it)
    if tl.max(slot, axis=0) > 0:  # no adapter row in this tile: `out` stays as it is
        d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            hit, any_hit = _chunk_hit(slot, offs_r, R, W)
            if any_hit:
                t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for s in range(0, SPLITS):  # in split order: the sum's bits fixed by K alone
                    t += tl.load(ws_ptr + (s * M + offs_m[:, None]).to(tl.int64) * R + offs_r[None, :],
                                 mask=m_ok[:, None] & r_ok[None, :], other=0.0)
                t = tl.where(hit, t.to(DT), tl.zeros_like(t).to(DT))
                bk = tl.load(b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :],
                             mask=n_ok[:, None] & r_ok[None, :], other=0.0)
                d = tl.dot(t, tl.trans(bk), d)
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        o_ok = m_ok[:, None] & n_ok[None, :]
        o = tl.load(o_ptrs, mask=o_ok, other=0.0)
        y = o.to(tl.float32) + d.to(DT).to(tl.float32)
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=o_ok)


@triton.jit
def row_slots(slot_ptr, offs_m, m_ok, LORA: tl.constexpr):
    """The rows' LoRA slots (0: none; all 0 without LORA)."""
    if LORA:
        slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=0).to(tl.int32)
    else:
        slot = tl.zeros_like(offs_m)
    return slot


# A GEMM kernel that joins the deltas (kernels/splitk_gemm.py, kernels/gate_up.py) walks its K range as it
# always does and, in the same loop, sums t = x[:, k] A[:, k]^T from the x tile it already holds and A's
# tile of the step (lora_a); after the loop join_deltas masks t to each row's own slot, rounds it and adds
# t B^T to the sums. The delta is linear in K, so a split-K program adds the share of its K range and the
# splits' sum is the whole delta. Nothing walks K a second time and the stacked A and B are weights (read
# before the PDL wait where the kernel reads its own weights there): the join costs the kernel one more
# MMA a K step and one after the loop, no launch, no side stream. All of the stacked rank is computed (no
# chunk skipping): JOIN_MAX_R bounds it; a bank with more columns takes the two kernels above.
JOIN_MAX_R = 128
# The GEMM kernels that read their operands by TMA read A's tiles by TMA too (one more descriptor; False:
# pointer loads, as the pointer kernels do; benchmarks/gpu_lora_join.py --a-loads both compares them: the
# o GEMM's join +1.48 -> +0.71 us, session 34)
A_BY_TMA = True


def a_descriptor(lora: LoraOperands | None, block_k: int, placeholder):
    """The TMA descriptor of A's [join_block_r, block_k] tiles for a TMA GEMM kernel, or `placeholder` (a
    descriptor of the kernel's own that it never reads for A) where A goes by pointer loads or there is none."""
    from surge.engines.kernels import tma

    if lora is None or not A_BY_TMA or not tma.usable(lora.a):
        return placeholder, False
    return tma.descriptor(lora.a, (join_block_r(lora.a.shape[0]), block_k)), True


@triton.jit
def lora_a(la_ptr, stride_la, offs_r, r_ok, offs_k, k_ok):
    """A's [BLOCK_R, BLOCK_K] tile of the K step at offs_k (zeros past R or K)."""
    return tl.load(la_ptr + offs_r[:, None].to(tl.int64) * stride_la + offs_k[None, :],
                   mask=r_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def lora_b(lb_ptr, stride_lb, offs_n, n_ok, offs_r, r_ok):
    """B's rows of the tile, [BLOCK_N, BLOCK_R]."""
    return tl.load(lb_ptr + offs_n[:, None].to(tl.int64) * stride_lb + offs_r[None, :],
                   mask=n_ok[:, None] & r_ok[None, :], other=0.0)


@triton.jit
def join_deltas(acc1, acc2, t, b1, b2, slot, offs_r, R, W, TWO: tl.constexpr, SWAP: tl.constexpr):
    """The tile's sums plus its rows' deltas: t ([BLOCK_M, BLOCK_R], the FP32 x A^T of the kernel's K range)
    zeroed where a row's slot does not own the column, rounded to the activations' dtype, times B's rows
    b1 (and b2 into acc2 with TWO: gate/up's halves share one x A^T). Tiles [BLOCK_M, BLOCK_N], transposed
    with SWAP. A row without a slot keeps its sums' bits; a row's delta depends on that row alone."""
    hit = (slot[:, None] == (offs_r // W + 1)[None, :]) & (offs_r < R)[None, :]
    tm = tl.where(hit, t.to(b1.dtype), tl.zeros_like(t).to(b1.dtype))
    has = slot > 0
    if SWAP:
        has2 = has[None, :]
    else:
        has2 = has[:, None]
    acc1 = tl.where(has2, mma(tm, b1, acc1, SWAP), acc1)
    if TWO:
        acc2 = tl.where(has2, mma(tm, b2, acc2, SWAP), acc2)
    return acc1, acc2


def lora_add_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
              width: int, pdl: bool = False) -> torch.Tensor:
    """out [M, N] (the module's product: BF16 / FP16, or an FP32 split-K partial) += each row's own
    adapter's delta, in place; returns out. x [M, K] the module's input; a [S * width, K] and b [N, S * width]
    the stacked slots (slot s in columns [(s - 1) width, s width)); slots [M] each row's slot, 0 for none."""
    if out.shape != (x.shape[0], b.shape[0]) or b.shape[1] != a.shape[0]:
        raise ValueError(f"shapes do not fit: out {list(out.shape)}, x {list(x.shape)}, a {list(a.shape)}, "
                         f"b {list(b.shape)}")
    return lora_expand_(out, lora_shrink(x, a, slots, width, pdl), b, slots, width, pdl)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, width: int, pdl: bool = False) -> torch.Tensor:
    """The first kernel: x A^T's FP32 partial sums over K splits, [splits, M, R] (lora_expand_ sums them)."""
    m, k = x.shape
    r = a.shape[0]
    if a.shape[1] != k or slots.shape != (m,):
        raise ValueError(f"shapes do not fit: x {list(x.shape)}, a {list(a.shape)}, slots {list(slots.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(1) != 1:
        raise ValueError("a must have contiguous rows")
    block_r = _block_r(r)
    splits = triton.cdiv(k, K_SPLIT)
    ws = torch.empty((splits, m, r), device=x.device, dtype=torch.float32)
    _lora_shrink[(triton.cdiv(r, block_r), splits, triton.cdiv(m, BLOCK_M))](
        x, a, slots, ws, m, k, r, width, x.stride(0), a.stride(0), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
        BLOCK_R=block_r, K_SPLIT=K_SPLIT, PDL=pdl, num_warps=4, **launch_kw(pdl))
    return ws


def lora_expand_(out: torch.Tensor, ws: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, width: int,
                 pdl: bool = False) -> torch.Tensor:
    """The second kernel: out += mask(sum of ws' splits) B^T, in place; returns out."""
    splits, m, r = ws.shape
    if out.shape != (m, b.shape[0]) or b.shape[1] != r or slots.shape != (m,):
        raise ValueError(f"shapes do not fit: out {list(out.shape)}, partials {list(ws.shape)}, b {list(b.shape)}")
    if out.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("out and b must have contiguous rows")
    _lora_expand[(triton.cdiv(out.shape[1], BLOCK_N), triton.cdiv(m, BLOCK_M))](
        ws, b, slots, out, m, out.shape[1], r, width, splits, b.stride(0), out.stride(0), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_R=_block_r(r), PDL=pdl, num_warps=4, **launch_kw(pdl))
    return out


def _block_r(r: int) -> int:
    return min(64, max(16, triton.next_power_of_2(r)))
