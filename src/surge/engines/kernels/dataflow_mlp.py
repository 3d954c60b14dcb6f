"""The decode step's MLP half of every layer in one persistent kernel, synchronized by data dependencies instead of
grid barriers (issue 18's persistent-kernel experiment, second design).

persistent_mlp.py separates the phases with grid barriers: three a layer, each waiting for every program (session
14, call 2: 19.3 us a layer at best against the three-kernel chain's 16.1). Here a program waits only for the
work its next item reads, counted in global memory:

* gate/up tile t of layer l reads the whole residual: it waits until all NCOL column tiles of layer l-1's residual
  update are final (`cols_done[l]`), then normalizes its A operand on the fly (RMSNorm from per-column-tile sums
  of squares; no norm phase, no norm barrier);
* down tile (column tile c, K split s) reads the gate/up output's columns of split s only: it waits for the gate/up
  tiles of that split (`split_done[l, s]`);
* the last of a column tile's S down tiles to finish (an acq_rel counter per column tile) sums the S partials in
  split order, adds them to the residual (rounded as the three kernels round), stores the column tile's sums of
  squares and marks the column tile final.

Every program walks the same global order of items (prologue, then a layer's gate/up tiles, its down tiles, ...,
epilogue), taking every P-th item; an item depends only on earlier items, so with all programs resident the
earliest unfinished item can always run: no deadlock. Waits are bounded (SPIN_LIMIT). Before a wait a program asks
L2 for its item's weights, so the wait overlaps the weight stream. Deterministic, and a row's bits do not depend
on the other rows (the sums of squares are per row, in column-tile order).

Measured, not adopted (docs/benchmarks/generate.md, session 14): 31.8 us a layer at best, twice the barrier
kernel's 17.5 and the three-kernel chain's 16.2 in the same call; the engine does not call this module.

Same contract as persistent_mlp.persistent_mlp (resid updated in place, the final h returned), same rounding
points; the row's mean square is summed per 32 or 64 columns, then over column tiles, instead of in one
reduction, so the last bits may differ from the three-kernel chain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from surge.engines.kernels.persistent_mlp import (_BM, BLOCK_M, _dot, _down_tile, _prefetch_down_tile, _prefetch_gu_tile,
                                                  _spin_until, _swiglu, checked_buffers, launch_resident)


@triton.jit
def _signal(ptr):
    tl.debug_barrier()  # the program's stores precede its release
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _inv_rms(sumsq_ptr, H, eps, NCOL: tl.constexpr):
    """1 / RMS of every row from the column tiles' sums of squares (summed in column-tile order)."""
    offs_m = tl.arange(0, _BM)
    sq = tl.zeros((_BM,), dtype=tl.float32)
    for c in tl.static_range(NCOL):
        sq += tl.load(sumsq_ptr + c * _BM + offs_m, cache_modifier=".cg")
    return tl.rsqrt(sq / H + eps)


@triton.jit
def _col_sumsq(resid_ptr, sumsq_ptr, M, H, c, BLOCK_D: tl.constexpr):
    offs_m = tl.arange(0, _BM)
    offs_n = c * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < H)
    x = tl.load(resid_ptr + offs_m[:, None] * H + offs_n[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    xf = x.to(tl.float32)
    tl.store(sumsq_ptr + c * _BM + offs_m, tl.sum(xf * xf, 1))


@triton.jit
def _gate_up_item(resid_ptr, sumsq_ptr, w_norm_ptr, wgu_ptr, act_ptr, done_ptr, split_ptr, M, H, I, eps, t,
                  K_SPLIT: tl.constexpr, NCOL: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                  LINES_G: tl.constexpr, PREFETCH: tl.constexpr, F32: tl.constexpr):
    offs_m = tl.arange(0, _BM)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = t * BLOCK_G + tl.arange(0, BLOCK_G)
    n_ok = offs_n < I
    if PREFETCH:  # this tile's gate and up rows into L2 while the residual is being finished
        _prefetch_gu_tile(wgu_ptr, I, H, t, BLOCK_G, LINES_G)
    _spin_until(done_ptr, NCOL, F32)
    inv = _inv_rms(sumsq_ptr, H, eps, NCOL)
    dt = act_ptr.dtype.element_ty
    a_ptrs = resid_ptr + offs_m[:, None] * H + offs_k[None, :]
    g_ptrs = wgu_ptr + offs_n[:, None].to(tl.int64) * H + offs_k[None, :]
    u_ptrs = g_ptrs + I.to(tl.int64) * H
    acc_g = tl.zeros((_BM, BLOCK_G), dtype=tl.float32)
    acc_u = tl.zeros((_BM, BLOCK_G), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        x = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg")
        wn = tl.load(w_norm_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        # add_rmsnorm's rounding: y = (x * rsqrt(var + eps)) rounded, then w * y rounded
        y = (x.to(tl.float32) * inv[:, None]).to(dt)
        a = (wn.to(tl.float32)[None, :] * y.to(tl.float32)).to(dt)
        g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g = _dot(a, tl.trans(g), acc_g, F32)
        acc_u = _dot(a, tl.trans(u), acc_u, F32)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = _swiglu(acc_g, acc_u, dt)
    tl.store(act_ptr + offs_m[:, None] * I + offs_n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])
    _signal(split_ptr + (t * BLOCK_G) // K_SPLIT)


@triton.jit
def _down_item(act_ptr, wd_ptr, part_ptr, resid_ptr, sumsq_ptr, split_ptr, arrive_ptr, done_next_ptr, M, H, I,
               c, s, SPLITS: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_K: tl.constexpr, LINES_D: tl.constexpr, PREFETCH: tl.constexpr, F32: tl.constexpr):
    offs_m = tl.arange(0, _BM)
    m_ok = offs_m < M
    offs_n = c * BLOCK_D + tl.arange(0, BLOCK_D)
    n_ok = offs_n < H
    if PREFETCH:
        _prefetch_down_tile(wd_ptr, H, I, c, s, K_SPLIT, BLOCK_D, LINES_D)
    _spin_until(split_ptr + s, tl.cdiv(tl.minimum(K_SPLIT, I - s * K_SPLIT), BLOCK_G), F32)
    acc = _down_tile(act_ptr, wd_ptr, M, H, I, c, s, K_SPLIT, BLOCK_D, BLOCK_K, F32, None, False)  # no preload
    tile = offs_m[:, None] * H + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(part_ptr + s * M * H + tile, acc, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrive_ptr + c, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:  # the column tile's last split: sum the partials in split order, finish the residual
        tl.debug_barrier()
        d = tl.load(part_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
        for j in tl.static_range(1, SPLITS):
            d += tl.load(part_ptr + j * M * H + tile, mask=mask, other=0.0, cache_modifier=".cg")
        dt = resid_ptr.dtype.element_ty
        x = tl.load(resid_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
        x = (x.to(tl.float32) + d.to(dt).to(tl.float32)).to(dt)
        tl.store(resid_ptr + tile, x, mask=mask)
        xf = x.to(tl.float32)
        tl.store(sumsq_ptr + c * _BM + offs_m, tl.sum(xf * xf, 1))
        _signal(done_next_ptr)


@triton.jit
def _out_row(resid_ptr, sumsq_ptr, w_norm_ptr, h_ptr, done_ptr, M, H, eps, r, NCOL: tl.constexpr,
             BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    _spin_until(done_ptr, NCOL, INTERP)
    offs_m = tl.arange(0, _BM)
    inv = tl.sum(tl.where(offs_m == r, _inv_rms(sumsq_ptr, H, eps, NCOL), 0.0), 0)  # row r's
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    dt = h_ptr.dtype.element_ty
    x = tl.load(resid_ptr + r * H + offs, mask=mask, other=0.0, cache_modifier=".cg")
    w = tl.load(w_norm_ptr + offs, mask=mask, other=0.0)
    y = (x.to(tl.float32) * inv).to(dt)
    tl.store(h_ptr + r * H + offs, (w.to(tl.float32) * y.to(tl.float32)).to(dt), mask=mask)


@triton.jit(do_not_specialize=["M", "nprog"])
def _dataflow_mlp(resid_ptr, h_ptr, act_ptr, part_ptr, sumsq_ptr, norm_ptr, wgu_ptr, wd_ptr, cnt_ptr, M, H, I, eps,
                  nprog, LAYERS: tl.constexpr, SPLITS: tl.constexpr, K_SPLIT: tl.constexpr, NCOL: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KD: tl.constexpr,
                  BLOCK_H: tl.constexpr, LINES_G: tl.constexpr, LINES_D: tl.constexpr, PREFETCH: tl.constexpr,
                  F32: tl.constexpr):
    # counters: cols_done[LAYERS + 1], then split_done[LAYERS, SPLITS], then col_arrivals[LAYERS, NCOL]
    done = cnt_ptr
    split = cnt_ptr + (LAYERS + 1)
    arrive = split + LAYERS * SPLITS
    tiles_g = tl.cdiv(I, BLOCK_G)
    per_layer = tiles_g + NCOL * SPLITS
    total = NCOL + LAYERS * per_layer + M
    for idx in range(tl.program_id(0), total, nprog):
        if idx < NCOL:  # prologue: the input residual's sums of squares
            _col_sumsq(resid_ptr, sumsq_ptr, M, H, idx, BLOCK_D)
            _signal(done)
        elif idx < NCOL + LAYERS * per_layer:
            j = idx - NCOL
            layer = j // per_layer
            j = j % per_layer
            w_norm = norm_ptr + tl.maximum(layer - 1, 0) * H  # the chain's norm weights (layer 0 reuses row 0)
            wgu = wgu_ptr + layer * (2 * H * I.to(tl.int64))
            wd = wd_ptr + layer * (H * I.to(tl.int64))
            if j < tiles_g:
                _gate_up_item(resid_ptr, sumsq_ptr, w_norm, wgu, act_ptr, done + layer, split + layer * SPLITS,
                              M, H, I, eps, j, K_SPLIT, NCOL, BLOCK_G, BLOCK_K, LINES_G, PREFETCH, F32)
            else:
                j -= tiles_g
                _down_item(act_ptr, wd, part_ptr, resid_ptr, sumsq_ptr, split + layer * SPLITS, arrive + layer * NCOL,
                           done + layer + 1, M, H, I, j % NCOL, j // NCOL, SPLITS, K_SPLIT, BLOCK_G, BLOCK_D,
                           BLOCK_KD, LINES_D, PREFETCH, F32)
        else:
            _out_row(resid_ptr, sumsq_ptr, norm_ptr + (LAYERS - 1) * H, h_ptr, done + LAYERS, M, H, eps,
                     idx - NCOL - LAYERS * per_layer, NCOL, BLOCK_H, F32)


def counters(layers: int, h: int, i: int, splits: int = 4, block_d: int = 32, block_kd: int = 256) -> int:
    """int32 counters a launch needs (zeroed before it): cols_done, split_done, col_arrivals."""
    k_split = triton.cdiv(triton.cdiv(i, splits), block_kd) * block_kd
    return layers + 1 + layers * triton.cdiv(i, k_split) + layers * triton.cdiv(h, block_d)


def dataflow_mlp(resid: torch.Tensor, norms: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, eps: float,
                 programs: int, counter: torch.Tensor, splits: int = 4, block_g: int = 32, block_d: int = 32,
                 block_k: int = 128, block_kd: int = 256, num_warps: int = 4, num_stages: int = 2,
                 prefetch: bool = True) -> torch.Tensor:
    """As persistent_mlp.persistent_mlp (resid [M <= 64, H] updated in place, norms [L, H], wgu [L, 2I, H],
    wd [L, H, I] -> h [M, H]); counter: int32 [counters(...)] zeroed before the launch. On a GPU all programs
    must be resident (ValueError otherwise); on the CPU (Triton's interpreter) use programs=1: one program
    walks the items in order, which is the dependency order."""
    m, h, layers, i, k_split, s, out, act, part = checked_buffers(resid, norms, wgu, wd, splits, block_kd,
                                                                  "dataflow_mlp")
    if k_split % block_g:
        raise ValueError(f"block_g ({block_g}) must divide the K split ({k_split})")
    ncol = triton.cdiv(h, block_d)
    need = counters(layers, h, i, splits, block_d, block_kd)
    if counter.numel() < need or counter.dtype != torch.int32:
        raise ValueError(f"counter must be int32 with at least {need} elements")
    if not resid.is_cuda and programs != 1:
        raise ValueError("on the CPU interpreter programs run one after another: use programs=1")
    sumsq = torch.zeros((ncol, BLOCK_M), device=resid.device, dtype=torch.float32)
    kw = dict(LAYERS=layers, SPLITS=s, K_SPLIT=k_split, NCOL=ncol, BLOCK_G=block_g, BLOCK_D=block_d,
              BLOCK_K=block_k, BLOCK_KD=block_kd, BLOCK_H=triton.next_power_of_2(h),
              LINES_G=triton.next_power_of_2(triton.cdiv(h * 2, 128)),
              LINES_D=triton.next_power_of_2(triton.cdiv(k_split * 2, 128)), PREFETCH=prefetch and resid.is_cuda,
              F32=not resid.is_cuda, num_warps=num_warps, num_stages=num_stages)
    args = (resid, out, act, part, sumsq, norms, wgu, wd, counter, m, h, i, eps, programs)
    if resid.is_cuda:
        launch_resident(_dataflow_mlp, args, programs, resid.device, **kw)
    else:
        _dataflow_mlp[(programs,)](*args, **kw)
    return out
