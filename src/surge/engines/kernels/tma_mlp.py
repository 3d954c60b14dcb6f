"""The decode step's MLP half of every layer in one persistent kernel whose weights stream into shared
memory by TMA (Gluon, Hopper): an experiment for issue 18, which the engine does not call.

Session 14's persistent kernel (persistent_mlp.py) ran the same chain with grid barriers between phases,
and its phases streamed the weights at ~2 TB/s: each program had a few K steps in flight (Triton's
software pipeline), and a phase's weights could not be asked for before its barrier except into L2 or
registers, both of which slowed it. Here every program owns one slice of a layer's gate/up weights and one
slice of its down weights and keeps **all of both in shared memory**: it asks for them (TMA bulk copies,
one mbarrier per 64-column chunk) as soon as the slice's buffers are free, i.e. right after the previous
layer used them, so the next layer's weights arrive while this layer's other phase, the norm and the grid
barriers run. Weights never depend on the previous phase; only the activations (h, act, the partials, a
few hundred KB in L2) wait for the barriers. For Qwen2-0.5B (H = 896, I = 4864) on 132 SMs: a gate/up
slice of 40 rows (2 x 40 x 896 BF16, 140 KB) and a down tile of 64 rows x 576 columns (72 KB).

Chain and rounding exactly as persistent_mlp.py (its module docstring): for l in layers,

    act  = SiLU(h @ Wg[l]^T) * (h @ Wu[l]^T)             phase G: program p, rows [p*BN, p*BN + BN) of I
    part = act @ Wd[l]^T as SPLITS FP32 partials           phase D: (64-column tile, K split) a program
    resid += sum(part) (rounded); h = RMSNorm(resid) * w[l]   phase N: one row a program

with h = RMSNorm(resid) * w[0] first. Products by warpgroup MMA with the activation in registers (the
batch on the MMA's M side, 64 rows; a row's result depends on that row alone) and the weight chunk in
shared memory. Barrier as persistent_mlp.py: a monotonic counter (zeroed by the caller before each launch),
one release atomic a program, thread 0 polling with acquire loads (bounded), activations read with `.cg`.

Measured, not adopted (docs/benchmarks/generate.md, session 15; benchmarks/gpu_tma_mlp.py, Qwen2-0.5B, M = 64, 24
layers in one CUDA graph): 35.2 us a layer against the decode step's three kernels' 16.2 (PDL). With no phase
computing, the weights and the three barriers alone take 10.3-10.5 us a layer (13.1 with the norm): while a
program waits at a barrier its slices are full and it asks for nothing, so the barriers are not hidden; the
gate/up phase then costs ~1.2 us a 64-column chunk, the round trip of its activation operand from L2.

Needs H and I multiples of 64, M <= 64, a Hopper GPU and a Triton with Gluon (3.5+).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from surge.engines.kernels.persistent_mlp import SPIN_LIMIT, SPIN_PTX

BLOCK_M = 64  # the MMA's M side holds the whole decode batch
CHUNK = 64  # columns of a weight chunk: 128-byte rows (the 128-byte swizzle), one mbarrier each
SMEM_LIMIT = 227 * 1024  # an H100 / H200 block's shared memory (opt-in)


@gluon.jit
def _spin_until(ptr, target):
    gl.inline_asm_elementwise(SPIN_PTX, "=r,l,r,r", [ptr, target, gl.full((), SPIN_LIMIT, gl.int32)], dtype=gl.int32,
                              is_pure=False, pack=1)
    gl.thread_barrier()


@gluon.jit
def _grid_sync(bar_ptr, target):
    gl.thread_barrier()  # every thread's stores of this phase precede the arrival
    gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")  # a scalar atomic: once a program
    _spin_until(bar_ptr, target)


@gluon.jit
def _issue_gate_up(g_desc, x_desc, g_smem, u_smem, gx_smem, ux_smem, bars, layer, n0, has_x, I: gl.constexpr,
                   BN: gl.constexpr, KG: gl.constexpr):
    """Ask for the program's gate and up rows of `layer`: BN rows from n0, and the 8 after them where has_x;
    whole K, one barrier a chunk for all its boxes. (Loops here are not unrolled: unrolled, the kernel's
    addresses alone took 202 registers a thread and its MMA phases spilled; session 15, call 2.)"""
    row = layer * (2 * I) + n0
    main: gl.constexpr = 2 * g_desc.block_type.nbytes
    extra: gl.constexpr = 2 * x_desc.block_type.nbytes
    for c in range(KG):
        bar = bars.index(c)
        mbarrier.expect(bar, main + extra, pred=has_x)  # exactly one of the two arrives
        mbarrier.expect(bar, main, pred=not has_x)
        tma.async_copy_global_to_shared(g_desc, [row, c * 64], bar, g_smem.index(c))
        tma.async_copy_global_to_shared(g_desc, [row + I, c * 64], bar, u_smem.index(c))
        tma.async_copy_global_to_shared(x_desc, [row + BN, c * 64], bar, gx_smem.index(c), pred=has_x)
        tma.async_copy_global_to_shared(x_desc, [row + I + BN, c * 64], bar, ux_smem.index(c), pred=has_x)


@gluon.jit
def _issue_down(d_desc, d_smem, bars, layer, n0, c0, nc, H: gl.constexpr):
    """Ask for rows [n0, n0 + BD) of `layer`'s down weight, chunks c0 .. c0 + nc - 1."""
    row = layer * H + n0
    for c in range(nc):
        bar = bars.index(c)
        mbarrier.expect(bar, d_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(d_desc, [row, (c0 + c) * 64], bar, d_smem.index(c))


@gluon.jit
def _swiglu_store(acc_g, acc_u, act_ptr, M, n0, I: gl.constexpr, N: gl.constexpr, acc_layout: gl.constexpr):
    dt: gl.constexpr = act_ptr.dtype.element_ty
    gf = acc_g.to(dt).to(gl.float32)  # silu_mul's arithmetic on the GEMM's rounded outputs
    y = (gf / (1.0 + gl.exp(-gf))).to(dt) * acc_u.to(dt)
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    ocol = n0 + gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout))
    gl.store(act_ptr + orow[:, None] * I + ocol[None, :], y, mask=(orow[:, None] < M) & (ocol[None, :] < I))


@gluon.jit
def _a_chunk(a_ptr, a_offs, a_mask, c, n):
    """Activation columns [64c, 64c + 64) of the batch, read from L2; zeros (no read) for c >= n. int32 offsets:
    a tensor of 64-bit pointers takes 64 registers a thread."""
    return gl.load(a_ptr + (a_offs + c * 64), mask=a_mask & (c < n), other=0.0, cache_modifier=".cg")


@gluon.jit
def _gate_up(h_ptr, act_ptr, g_smem, u_smem, gx_smem, ux_smem, bars, parity, M, n0, has_x, H: gl.constexpr,
             I: gl.constexpr, BN: gl.constexpr, KG: gl.constexpr, num_warps: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    x_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, 8, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    ax_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=x_layout, k_width=2)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, a_layout))
    a_offs = rows[:, None] * H + cols[None, :]
    a_mask = rows[:, None] < M
    acc_g = gl.zeros([64, BN], gl.float32, acc_layout)
    acc_u = gl.zeros([64, BN], gl.float32, acc_layout)
    acc_gx = gl.zeros([64, 8], gl.float32, x_layout)
    acc_ux = gl.zeros([64, 8], gl.float32, x_layout)
    # Activation chunks asked for two ahead of their MMAs. Measured (session 15, calls 3-4): no faster than one at
    # a time, ~1.2 us a chunk either way: the rotation below compiles to register copies of the registers this
    # iteration's own loads fill (SASS), so each iteration still waits an L2 round trip; unrolled, the kernel spills.
    a_cur = _a_chunk(h_ptr, a_offs, a_mask, 0, KG)
    a_nxt = _a_chunk(h_ptr, a_offs, a_mask, 1, KG)
    for c in range(KG):
        a_new = _a_chunk(h_ptr, a_offs, a_mask, c + 2, KG)
        mbarrier.wait(bars.index(c), parity)
        # gate and up in flight together, one wait (call 4: the same time as two synchronous MMAs)
        acc_g = warpgroup_mma(a_cur, g_smem.index(c).permute((1, 0)), acc_g, is_async=True)
        acc_u = warpgroup_mma(a_cur, u_smem.index(c).permute((1, 0)), acc_u, is_async=True)
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
        if has_x:
            ax = gl.convert_layout(a_cur, ax_layout)
            acc_gx = warpgroup_mma(ax, gx_smem.index(c).permute((1, 0)), acc_gx)
            acc_ux = warpgroup_mma(ax, ux_smem.index(c).permute((1, 0)), acc_ux)
        a_cur = a_nxt
        a_nxt = a_new
    _swiglu_store(acc_g, acc_u, act_ptr, M, n0, I, BN, acc_layout)
    if has_x:
        _swiglu_store(acc_gx, acc_ux, act_ptr, M, n0 + BN, I, 8, x_layout)


@gluon.jit
def _down(act_ptr, part_ptr, d_smem, bars, parity, M, n0, c0, nc, split, H: gl.constexpr, I: gl.constexpr,
          BD: gl.constexpr, num_warps: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BD, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, a_layout))
    a_ptr = act_ptr + c0 * 64
    a_offs = rows[:, None] * I + cols[None, :]
    a_mask = rows[:, None] < M
    acc = gl.zeros([64, BD], gl.float32, acc_layout)
    a_cur = _a_chunk(a_ptr, a_offs, a_mask, 0, nc)
    a_nxt = _a_chunk(a_ptr, a_offs, a_mask, 1, nc)
    for c in range(nc):
        a_new = _a_chunk(a_ptr, a_offs, a_mask, c + 2, nc)
        mbarrier.wait(bars.index(c), parity)
        acc = warpgroup_mma(a_cur, d_smem.index(c).permute((1, 0)), acc)
        a_cur = a_nxt
        a_nxt = a_new
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    ocol = n0 + gl.arange(0, BD, layout=gl.SliceLayout(0, acc_layout))
    ws = part_ptr + split * M * H
    gl.store(ws + orow[:, None] * H + ocol[None, :], acc, mask=orow[:, None] < M)


@gluon.jit
def _norm_rows(resid_ptr, part_ptr, w_ptr, h_ptr, M, eps, pid, nprog, HAS_DELTA: gl.constexpr,
               SPLITS: gl.constexpr, H: gl.constexpr, BLOCK_H: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_H // (32 * num_warps)], [32], [num_warps], [0])
    offs = gl.arange(0, BLOCK_H, layout=layout)
    mask = offs < H
    w = gl.load(w_ptr + offs, mask=mask, other=0.0)
    dt: gl.constexpr = resid_ptr.dtype.element_ty
    for r in range(pid, M, nprog):
        row = r * H
        x = gl.load(resid_ptr + row + offs, mask=mask, other=0.0)  # this row is this program's, every layer
        if HAS_DELTA:
            d = gl.load(part_ptr + row + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in gl.static_range(1, SPLITS):
                d += gl.load(part_ptr + s * M * H + row + offs, mask=mask, other=0.0, cache_modifier=".cg")
            x = (x.to(gl.float32) + d.to(dt).to(gl.float32)).to(dt)
            gl.store(resid_ptr + row + offs, x, mask=mask)
        xf = x.to(gl.float32)
        var = gl.sum(xf * xf, 0) / H
        y = (xf * gl.rsqrt(var + eps)).to(dt)
        gl.store(h_ptr + row + offs, (w.to(gl.float32) * y.to(gl.float32)).to(dt), mask=mask)


@gluon.jit
def _wait_chunks(bars, parity, n):
    """Wait for chunks 0 .. n - 1 to land without using them (WORK: a phase that only streams its weights)."""
    for c in range(n):
        mbarrier.wait(bars.index(c), parity)


@gluon.jit
def _tma_mlp(resid_ptr, h_ptr, act_ptr, part_ptr, norm_ptr, gu_desc, gx_desc, d_desc, bar_ptr, M, eps, first_layer,
             last_layer, base, PDL: gl.constexpr, WORK: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
             BN: gl.constexpr, NX: gl.constexpr, BD: gl.constexpr, KD: gl.constexpr, SPLITS: gl.constexpr,
             BLOCK_H: gl.constexpr, num_warps: gl.constexpr):
    p = gl.program_id(0)
    nprog = gl.num_programs(0)
    KG: gl.constexpr = H // 64
    NTD: gl.constexpr = H // BD
    KT_D: gl.constexpr = I // 64
    dt: gl.constexpr = gu_desc.dtype
    g_smem = gl.allocate_shared_memory(dt, [KG, BN, 64], gu_desc.layout)
    u_smem = gl.allocate_shared_memory(dt, [KG, BN, 64], gu_desc.layout)
    gx_smem = gl.allocate_shared_memory(dt, [KG, 8, 64], gx_desc.layout)
    ux_smem = gl.allocate_shared_memory(dt, [KG, 8, 64], gx_desc.layout)
    d_smem = gl.allocate_shared_memory(dt, [KD, BD, 64], d_desc.layout)
    g_bars = gl.allocate_shared_memory(gl.int64, [KG, 1], mbarrier.MBarrierLayout())
    d_bars = gl.allocate_shared_memory(gl.int64, [KD, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(KG):
        mbarrier.init(g_bars.index(c), count=1)
    for c in gl.static_range(KD):
        mbarrier.init(d_bars.index(c), count=1)
    fence_async_shared()

    # gate/up: BN rows a program, 8 more for the first NX programs (I / 8 groups of 8 rows dealt evenly)
    has_x = p < NX
    n0 = p * BN + 8 * gl.minimum(p, NX)
    has_d = p < NTD * SPLITS
    split = p // NTD
    d_n0 = (p % NTD) * BD
    d_c0 = split * KD
    d_nc = gl.minimum(KD, KT_D - d_c0)
    # the first layer's weights, whole slices, before anything waits (with PDL: while the previous kernel runs)
    _issue_gate_up(gu_desc, gx_desc, g_smem, u_smem, gx_smem, ux_smem, g_bars, first_layer, n0, has_x, I, BN, KG)
    if has_d:
        _issue_down(d_desc, d_smem, d_bars, first_layer, d_n0, d_c0, d_nc, H)
    if PDL:  # activations and the counter are the previous kernels' to write until they complete
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    arrivals = base
    if first_layer == 0:
        if WORK & 4:
            _norm_rows(resid_ptr, part_ptr, norm_ptr, h_ptr, M, eps, p, nprog, False, SPLITS, H, BLOCK_H, num_warps)
        arrivals += nprog
        _grid_sync(bar_ptr, arrivals)
    for layer in range(first_layer, last_layer):
        parity = (layer - first_layer) & 1
        if WORK & 1:
            _gate_up(h_ptr, act_ptr, g_smem, u_smem, gx_smem, ux_smem, g_bars, parity, M, n0, has_x, H, I, BN, KG,
                     num_warps)
        else:
            _wait_chunks(g_bars, parity, KG)
        gl.thread_barrier()  # every warp's MMAs have read the buffers before they are refilled
        if layer + 1 < last_layer:
            _issue_gate_up(gu_desc, gx_desc, g_smem, u_smem, gx_smem, ux_smem, g_bars, layer + 1, n0, has_x, I, BN,
                           KG)
        arrivals += nprog
        _grid_sync(bar_ptr, arrivals)
        if has_d:
            if WORK & 2:
                _down(act_ptr, part_ptr, d_smem, d_bars, parity, M, d_n0, d_c0, d_nc, split, H, I, BD, num_warps)
            else:
                _wait_chunks(d_bars, parity, d_nc)
            gl.thread_barrier()
            if layer + 1 < last_layer:
                _issue_down(d_desc, d_smem, d_bars, layer + 1, d_n0, d_c0, d_nc, H)
        arrivals += nprog
        _grid_sync(bar_ptr, arrivals)
        if WORK & 4:
            _norm_rows(resid_ptr, part_ptr, norm_ptr + layer * H, h_ptr, M, eps, p, nprog, True, SPLITS, H, BLOCK_H,
                       num_warps)
        if layer + 1 < last_layer:
            arrivals += nprog
            _grid_sync(bar_ptr, arrivals)
    for c in gl.static_range(KG):
        mbarrier.invalidate(g_bars.index(c))
    for c in gl.static_range(KD):
        mbarrier.invalidate(d_bars.index(c))


def barriers(last: int, first: int = 0) -> int:
    """Grid barriers a launch of layers [first, last) passes: it adds this times the programs to the counter."""
    return (1 if first == 0 else 0) + 3 * (last - first) - 1


def plan(h: int, i: int, programs: int, block_d: int = 64) -> dict:
    """The work split for `programs` programs. Gate/up: I's I / 8 groups of 8 rows dealt evenly, BN = 8 x (groups
    // programs) rows a program (a power of two: TMA boxes and tensors are) and 8 more for the first NX programs.
    Down: H / block_d column tiles x SPLITS K ranges of KD 64-column chunks. smem: the slices' bytes a program."""
    groups = i // 8
    base, nx = divmod(groups, programs)
    if base < 1 or base & (base - 1):
        raise ValueError(f"{groups} groups of 8 rows over {programs} programs: {base} a program is not a power of two")
    ntd = h // block_d
    if ntd > programs:
        raise ValueError(f"{programs} programs cannot hold {ntd} down tiles of {block_d} columns")
    kt = i // CHUNK
    kd = triton.cdiv(kt, max(1, programs // ntd))
    splits = triton.cdiv(kt, kd)
    smem = (2 * (h // CHUNK) * (8 * base + 8) + kd * block_d) * CHUNK * 2
    return {"BN": 8 * base, "NX": nx, "BD": block_d, "KD": kd, "SPLITS": splits, "smem": smem}


def tma_mlp(resid: torch.Tensor, norms: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, eps: float,
            counter: torch.Tensor, programs: int | None = None, block_d: int = 64, num_warps: int = 4,
            layers: tuple[int, int] | None = None, arrivals: int = 0, out: torch.Tensor | None = None,
            pdl: bool = False, work: int = 7) -> torch.Tensor:
    """resid [M, H] (updated in place), norms [L, H], wgu [L, 2I, H] (gate rows then up rows), wd [L, H, I], BF16 or
    FP16 on a Hopper GPU -> h [M, H]: the chain of persistent_mlp.persistent_mlp (module docstring) in one launch.
    counter: int32 [1] reading `arrivals` before the launch (zero it for a first launch); the launch adds
    barriers(last, first) * programs. programs: at most one an SM (default: every SM).
    layers: (first, last) runs those layers only; a launch with first > 0 continues from the h of the launch
    before it, passed as `out` (and written there again). pdl: a programmatic dependent launch, which asks for
    its first layer's weights before it waits for the kernel ahead of it. work: the phases that compute (1 gate/up,
    2 down, 4 norm; 7 = all, the others leave h undefined: for timing where the time goes).
    Raises ValueError for shapes it does not take (H, I multiples of 64, M <= 64) or a plan that does not fit."""
    m, h = resid.shape
    n_layers, two_i, k = wgu.shape
    i = two_i // 2
    first, last = layers or (0, n_layers)
    if m > BLOCK_M or k != h or wd.shape != (n_layers, h, i) or norms.shape != (n_layers, h):
        raise ValueError("shapes: resid [M<=64, H], norms [L, H], wgu [L, 2I, H], wd [L, H, I]")
    if h % CHUNK or i % CHUNK:
        raise ValueError(f"H and I must be multiples of {CHUNK}, not {h} and {i}")
    if (not all(t.is_contiguous() for t in (resid, norms, wgu, wd))
            or resid.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError("tma_mlp needs contiguous BF16 / FP16 tensors")
    if not 0 <= first < last <= n_layers or (first > 0 and out is None):
        raise ValueError(f"layers {first}..{last} of {n_layers}; a launch after the first needs the h it continues")
    sms = torch.cuda.get_device_properties(resid.device).multi_processor_count
    programs = programs or sms
    if programs > sms:  # one program an SM: its weight slices fill the SM's shared memory
        raise ValueError(f"{programs} programs cannot all be resident (one an SM, {sms} SMs)")
    pl = plan(h, i, programs, block_d)
    if pl["smem"] > SMEM_LIMIT - 4096:
        raise ValueError(f"the weight slices need {pl['smem']} bytes of shared memory a program; use more programs")
    gdt = gl.bfloat16 if resid.dtype == torch.bfloat16 else gl.float16
    rows = n_layers * two_i
    gu_desc = TensorDescriptor.from_tensor(wgu.view(rows, h), [pl["BN"], CHUNK],
                                           gl.NVMMASharedLayout.get_default_for([pl["BN"], CHUNK], gdt))
    gx_desc = TensorDescriptor.from_tensor(wgu.view(rows, h), [8, CHUNK],
                                           gl.NVMMASharedLayout.get_default_for([8, CHUNK], gdt))
    d_desc = TensorDescriptor.from_tensor(wd.view(n_layers * h, i), [block_d, CHUNK],
                                          gl.NVMMASharedLayout.get_default_for([block_d, CHUNK], gdt))
    out = torch.empty_like(resid) if out is None else out
    act = torch.empty((m, i), device=resid.device, dtype=resid.dtype)
    part = torch.empty((pl["SPLITS"], m, h), device=resid.device, dtype=torch.float32)
    _tma_mlp[(programs,)](resid, out, act, part, norms, gu_desc, gx_desc, d_desc, counter, m, eps, first, last,
                          arrivals, PDL=pdl, WORK=work, H=h, I=i, BN=pl["BN"], NX=pl["NX"], BD=block_d, KD=pl["KD"],
                          SPLITS=pl["SPLITS"], BLOCK_H=max(triton.next_power_of_2(h), 32 * num_warps),
                          num_warps=num_warps, **({"launch_pdl": True} if pdl else {}))
    return out
