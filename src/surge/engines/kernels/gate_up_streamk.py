"""SiLU(x @ W_gate^T) * (x @ W_up^T) with the work dealt evenly over every SM (stream-K, Triton).

kernels/gate_up.py gives each program one BLOCK_N-wide output tile and its whole K: at Qwen2-0.5B's
decode shape (I = 4864, 64-wide tiles) that is 76 programs, so 76 of the H200's 132 SMs stream the
17 MB of weights and the rest idle; an SM streams ~30-40 GB/s whatever the others do (session 18's
gate/up ran at 2.2 TB/s on 76 SMs, session 15's TMA stream at 4 TB/s on 132). Here the (tile, K step)
units, tiles x K / BLOCK_K of them, are cut into one contiguous run a program, as even as whole units
allow, so every SM streams its share. A run covering a tile's whole K finishes it at once; a tile cut
between programs has each piece's FP32 partial sums stored in a workspace, and the piece that
completes the tile (a per-tile counter says which) sums the pieces in K order, whoever finished
them, and applies the epilogue. No program waits for another (no spinning, no co-residency needed).

Deterministic and batch-invariant: the runs depend on (I, K, the grid) only, the pieces are summed
in K order, and every launch tiles M by the same 64 rows. The partial sums are rounded at the pieces'
boundaries, so the result may differ from gate_up.py's in the last bits (tests hold both to float64).
Counters return to zero as each tile completes, so a CUDA graph replays the kernel as captured.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from surge.engines.kernels import tma
from surge.engines.kernels.gate_up import _silu_mul_store, mma
from surge.engines.kernels.pdl import launch_kw, prefetch_l2, wait_then_release

BLOCK_M = 64
MAX_M = 64


@dataclass(frozen=True)
class StreamKPlan:
    block_n: int = 64
    block_k: int = 128
    programs: int = 0  # 0: one a streaming multiprocessor
    num_warps: int = 4
    num_stages: int = 4


# Measured plans by (I, K) (the engine takes one where its weights allow; none: kernels/gate_up.py's
# one-tile-a-program kernel). Filled from benchmarks/gpu_gate_up_streamk.py and the engine A/B
# (docs/benchmarks/generate.md, session 25).
PLANS: dict[tuple[int, int], StreamKPlan] = {}


def plan_for(i: int, k: int) -> StreamKPlan | None:
    return PLANS.get((i, k))


@functools.lru_cache(maxsize=None)
def layout(tiles: int, ksteps: int, programs: int) -> int:
    """The most pieces any tile is cut into when tiles x ksteps units are dealt to `programs` runs."""
    total = tiles * ksteps

    def owner(u):  # as _owner in the kernel
        return ((u + 1) * programs - 1) // total

    return max(owner(t * ksteps + ksteps - 1) - owner(t * ksteps) + 1 for t in range(tiles))


@triton.jit
def _owner(u, TOTAL, P):
    """The program whose run holds unit u: the largest p with p * TOTAL // P <= u."""
    return ((u + 1) * P - 1) // TOTAL


@triton.jit
def _prefetch_run(w_ptr, start, end, I, KSTEPS, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPAN: tl.constexpr):
    """The run's weight rows (gate and up) into L2 while the previous kernel runs (PDL): SPAN 128-byte
    lines a row, over the run's units in order (the last unit's lines repeated past the run's end)."""
    LPK: tl.constexpr = BLOCK_K * 2 // 128  # lines a row a unit
    j = tl.arange(0, SPAN)
    unit = tl.minimum(start + j // LPK, end - 1)
    tile = unit // KSTEPS
    byte = ((unit - tile * KSTEPS) * BLOCK_K * 2 + (j % LPK) * 128).to(tl.int64)
    rows = (tile * BLOCK_N).to(tl.int64)[None, :] + tl.arange(0, BLOCK_N).to(tl.int64)[:, None]
    base = w_ptr.to(tl.pointer_type(tl.int8)) + rows * stride_wn * 2 + byte[None, :]
    prefetch_l2(base)
    prefetch_l2(base + I.to(tl.int64) * stride_wn * 2)


@triton.jit(do_not_specialize=["M"])
def _gate_up_streamk(a_desc, w_desc, w_ptr, ws_ptr, cnt_ptr, out_ptr, M, I, KSTEPS, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIECES: tl.constexpr,
                     PDL: tl.constexpr, SPAN: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    TOTAL = (I // BLOCK_N) * KSTEPS
    start = (pid * TOTAL) // P
    end = ((pid + 1) * TOTAL) // P
    if PDL:
        _prefetch_run(w_ptr, start, end, I, KSTEPS, stride_wn, BLOCK_N, BLOCK_K, SPAN)
    wait_then_release(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_t = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # a piece's elements, row-major
    u = start
    while u < end:
        tile = u // KSTEPS
        k0 = u - tile * KSTEPS
        k1 = tl.minimum(KSTEPS, k0 + end - u)
        n0 = tile * BLOCK_N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k1):
            a = a_desc.load([0, k * BLOCK_K])
            acc_g = mma(a, w_desc.load([n0, k * BLOCK_K]), acc_g, False)
            acc_u = mma(a, w_desc.load([I + n0, k * BLOCK_K]), acc_u, False)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if k1 - k0 == KSTEPS:  # the whole K in this run
            _silu_mul_store(acc_g, acc_u, out_ptr, offs_m, offs_n, offs_m < M, offs_n < I, stride_om, False)
        else:
            first = _owner(tile * KSTEPS, TOTAL, P)
            piece = ws_ptr + ((tile * PIECES + pid - first) * 2).to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(piece + offs_t, acc_g)
            tl.store(piece + BLOCK_M * BLOCK_N + offs_t, acc_u)
            tl.debug_barrier()  # every thread's stores issued before the count that publishes them
            done = tl.atomic_add(cnt_ptr + tile, k1 - k0, sem="acq_rel", scope="gpu") + (k1 - k0)
            if done == KSTEPS:  # this piece completed the tile: sum the pieces in K order
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                tl.debug_barrier()  # the acquire (one thread's) before any thread reads the pieces
                g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                base = ws_ptr + (tile * PIECES * 2).to(tl.int64) * (BLOCK_M * BLOCK_N)
                for q in range(0, _owner(tile * KSTEPS + KSTEPS - 1, TOTAL, P) - first + 1):
                    at = base + (q * 2 * BLOCK_M * BLOCK_N) + offs_t
                    g += tl.load(at, cache_modifier=".cg")
                    up += tl.load(at + BLOCK_M * BLOCK_N, cache_modifier=".cg")
                _silu_mul_store(g, up, out_ptr, offs_m, offs_n, offs_m < M, offs_n < I, stride_om, False)
        u = tile * KSTEPS + k1


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def usable(x: torch.Tensor, w: torch.Tensor, plan: StreamKPlan) -> bool:
    """TMA reads both tensors, I is a whole number of tiles and the batch fits one M tile."""
    i = w.shape[0] // 2
    return x.shape[0] <= MAX_M and i % plan.block_n == 0 and tma.usable(x, w)


def _grid(w: torch.Tensor, plan: StreamKPlan) -> tuple[int, int, int, int]:
    """(tiles, K steps, programs, most pieces a tile) of a [2I, K] weight under `plan`."""
    i, k = w.shape[0] // 2, w.shape[1]
    tiles, ksteps = i // plan.block_n, triton.cdiv(k, plan.block_k)
    p = min(plan.programs or _sm_count(w.device.index or 0), tiles * ksteps)
    return tiles, ksteps, p, layout(tiles, ksteps, p)


def workspace(w: torch.Tensor, plan: StreamKPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP32 pieces, int32 per-tile counters at zero) for a [2I, K] CUDA weight: one pair a layer, made
    once (the counters must start at zero; the kernel leaves them there)."""
    tiles, _, _, pieces = _grid(w, plan)
    ws = torch.empty(tiles * pieces * 2 * BLOCK_M * plan.block_n, device=w.device, dtype=torch.float32)
    return ws, torch.zeros(tiles, device=w.device, dtype=torch.int32)


def gate_up_silu_streamk(x: torch.Tensor, w: torch.Tensor, plan: StreamKPlan, ws: torch.Tensor, counters: torch.Tensor,
                         pdl: bool = False) -> torch.Tensor:
    """x [M <= 64, K], w [2I, K] (gate rows, then up rows) -> SiLU(x @ W_gate^T) * (x @ W_up^T) [M, I], as
    kernels/gate_up.gate_up_silu computes it up to where the K sums are cut; `ws`, `counters` from
    workspace(w, plan) (one pair a layer; a kernel in flight owns its pair). Needs usable(x, w, plan)."""
    if not usable(x, w, plan):
        raise ValueError("stream-K gate/up needs TMA-readable tensors, I a multiple of block_n and M <= 64")
    m = x.shape[0]
    i = w.shape[0] // 2
    tiles, ksteps, p, pieces = _grid(w, plan)
    if ws.numel() < tiles * pieces * 2 * BLOCK_M * plan.block_n or counters.numel() < tiles:
        raise ValueError("workspace too small for this weight and grid")
    out = torch.empty((m, i), device=x.device, dtype=x.dtype)
    span = triton.next_power_of_2(triton.cdiv(tiles * ksteps, p) * plan.block_k * 2 // 128)
    _gate_up_streamk[(p,)](tma.descriptor(x, (BLOCK_M, plan.block_k)), tma.descriptor(w, (plan.block_n, plan.block_k)),
                           w, ws, counters, out, m, i, ksteps, w.stride(0), out.stride(0), BLOCK_M=BLOCK_M,
                           BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, PIECES=pieces, PDL=pdl, SPAN=span,
                           num_warps=plan.num_warps, num_stages=plan.num_stages, **launch_kw(pdl))
    return out
