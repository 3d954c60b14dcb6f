"""The decode step's MLP half of every layer in one persistent kernel (Triton), an experiment for issue 18.

A decode step at 64 streams is ~170 kernels of 2-8 us, and their fixed costs (launch, the first DRAM
round trips, the tail), not their bytes, make the step 2.8x its memory floor (docs/benchmarks/
generate.md, sessions 10-12; PDL and L2 prefetch from a side stream took what they could). The design
left is a persistent kernel: one grid of co-resident programs walks the phases of many layers, a
grid-wide barrier between phases instead of a kernel boundary, each program prefetching the weights of
its next phase into L2 before it waits at the barrier, so weight streams stay in flight across phases.

Measured, not adopted (docs/benchmarks/generate.md, session 14; benchmarks/gpu_persistent_mlp.py): the engine
does not call this module. At Qwen2-0.5B's shapes, M = 64, 24 layers in one CUDA graph, the best plan (264
programs, two an SM) took 16.63 us a layer without the L2 prefetch (17.50 with it) against the three-kernel
chain's 16.21 with PDL (17.94 without): a grid barrier costs ~1.2 us (3.47 us a layer for three), about what PDL
leaves of a kernel boundary, and the phases themselves stream weights at ~2 TB/s, latency-bound like the kernels;
`preload` (each phase's first weight block read before its barrier) took 28-30 us a layer.

This module measures that design on the part of a layer that is pure GEMM and normalization, the MLP
chain the decode step runs as three kernels (`add_rmsnorm` -> `gate_up_silu` -> split-K down, whose
partials the next `add_rmsnorm` sums): for l in layers,

    act  = SiLU(h @ Wg[l]^T) * (h @ Wu[l]^T)            phase G: BLOCK_N-wide slices of I
    part = act @ Wd[l]^T as SPLITS FP32 partials          phase D: BLOCK_N x K-range tiles
    resid += sum(part) (rounded); h = RMSNorm(resid) * w[l]   phase N: one row a program

with h = RMSNorm(resid) * w[0] first. Rounding as the three kernels round (each product to the
activation dtype, SiLU in FP32 then rounded, the partials summed in split order then rounded before
the residual add). The result is deterministic and a row's bits do not depend on the other rows.

`persistent_mlp(..., sync=True)` is one launch for all layers; `sync=False` launches one phase at a
time with the same code (what Triton's CPU interpreter can run: it executes programs one after another,
so a grid barrier there would wait forever). The grid must be co-resident: a synchronized launch is refused
when `programs` exceeds what the compiled kernel's registers and shared memory let the SMs hold
(`resident_programs`). Barrier: a monotonic counter in global memory (zeroed by the caller before each
launch, e.g. inside the CUDA graph); each program adds 1 (release, GPU scope, one thread: Triton executes a
scalar atomic once a program), then its thread 0 polls with acquire loads until all have arrived
(`_spin_until`, bounded); cross-program data is read with `.cg` loads (L2, not the SM's possibly stale L1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from surge.engines.kernels.pdl import prefetch_l2

BLOCK_M = 64
_BM = tl.constexpr(BLOCK_M)  # the kernels' view: one M tile holds the whole decode batch
SPIN_LIMIT = tl.constexpr(1 << 26)  # polls of the barrier counter before a program gives up (~seconds; a failed launch, not a hang)
# Thread 0 polls the int32 at $1 with acquire loads until it reaches $2 or $3 polls have passed ($0: the polls).
# Shared with the Gluon kernel (tma_mlp.py), whose barrier is the same.
SPIN_PTX = tl.constexpr(
    "{\n\t.reg .pred %sp_a, %sp_b, %sp_c;\n\t.reg .b32 %sv, %sn, %st;\n\t"
    "mov.u32 %st, %tid.x;\n\tsetp.ne.u32 %sp_a, %st, 0;\n\tmov.u32 %sn, 0;\n\t@%sp_a bra SPIN_END${:uid};\n"
    "SPIN_LOOP${:uid}:\n\tld.acquire.gpu.global.b32 %sv, [$1];\n\tadd.u32 %sn, %sn, 1;\n\t"
    "setp.lt.s32 %sp_b, %sv, $2;\n\tsetp.lt.u32 %sp_c, %sn, $3;\n\tand.pred %sp_b, %sp_b, %sp_c;\n\t"
    "@%sp_b bra SPIN_LOOP${:uid};\nSPIN_END${:uid}:\n\tmov.u32 $0, %sn;\n\t}")


@triton.jit
def _spin_until(ptr, target, INTERP: tl.constexpr):
    """Wait until the int32 at ptr reaches target (bounded by SPIN_LIMIT polls): thread 0 of the program polls
    with acquire loads, the others wait for it at the CTA barrier (which orders their later loads after its
    acquire). Session 14, call 4: every thread polling (128 a program, 264 programs on one counter) cost ~1.9 us
    a grid barrier."""
    if INTERP:  # Triton's CPU interpreter runs no PTX, and its programs one at a time
        seen = tl.load(ptr)
        spins = 0
        while (seen < target) & (spins < SPIN_LIMIT):
            seen = tl.load(ptr)
            spins += 1
    else:
        tl.inline_asm_elementwise(SPIN_PTX, "=r,l,r,r", [ptr, target, tl.full((), SPIN_LIMIT, tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _grid_sync(bar_ptr, target, SYNC: tl.constexpr):
    if SYNC:
        tl.debug_barrier()  # every thread's stores of this phase precede the arrival
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")  # one thread a program (a scalar atomic)
        _spin_until(bar_ptr, target, False)


@triton.jit
def _norm_rows(resid_ptr, part_ptr, w_ptr, h_ptr, M, H, eps, pid, nprog, HAS_DELTA: tl.constexpr,
               SPLITS: tl.constexpr, BLOCK_H: tl.constexpr):
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    for r in range(pid, M, nprog):
        row = r * H  # M * H < 2**31
        x = tl.load(resid_ptr + row + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_DELTA:
            d = tl.load(part_ptr + row + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                d += tl.load(part_ptr + s * M * H + row + offs, mask=mask, other=0.0, cache_modifier=".cg")
            dt = resid_ptr.dtype.element_ty
            x = (x.to(tl.float32) + d.to(dt).to(tl.float32)).to(dt)
            tl.store(resid_ptr + row + offs, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / H
        y = (xf * tl.rsqrt(var + eps)).to(h_ptr.dtype.element_ty)
        # BF16 x BF16 is exact in FP32: one rounding, as the native product rounds (and the CPU interpreter
        # multiplies BF16 only through FP32)
        tl.store(h_ptr + row + offs, (w.to(tl.float32) * y.to(tl.float32)).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_gu_tile(wgu_ptr, I, H, t, BLOCK_G: tl.constexpr, LINES_G: tl.constexpr):
    """Ask L2 for gate/up tile t's gate and up rows (whole K)."""
    line = tl.minimum(tl.arange(0, LINES_G).to(tl.int64) * 128, H.to(tl.int64) * 2 - 1)
    rows = tl.minimum(t * BLOCK_G + tl.arange(0, BLOCK_G), I - 1).to(tl.int64)
    base = wgu_ptr.to(tl.pointer_type(tl.int8)) + rows[:, None] * H * 2 + line[None, :]
    prefetch_l2(base)
    prefetch_l2(base + I.to(tl.int64) * H * 2)


@triton.jit
def _prefetch_gu(wgu_ptr, I, H, pid, nprog, BLOCK_G: tl.constexpr, LINES_G: tl.constexpr):
    for t in range(pid, tl.cdiv(I, BLOCK_G), nprog):
        _prefetch_gu_tile(wgu_ptr, I, H, t, BLOCK_G, LINES_G)


@triton.jit
def _prefetch_down_tile(wd_ptr, H, I, nt, s, K_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, LINES_D: tl.constexpr):
    row_bytes = (tl.minimum(I - s * K_SPLIT, K_SPLIT) * 2).to(tl.int64)
    line = tl.minimum(tl.arange(0, LINES_D).to(tl.int64) * 128, row_bytes - 1)
    rows = tl.minimum(nt * BLOCK_D + tl.arange(0, BLOCK_D), H - 1).to(tl.int64)
    prefetch_l2((wd_ptr + s * K_SPLIT).to(tl.pointer_type(tl.int8)) + rows[:, None] * I * 2 + line[None, :])


@triton.jit
def _prefetch_down(wd_ptr, H, I, pid, nprog, K_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
                   LINES_D: tl.constexpr):
    n_col = tl.cdiv(H, BLOCK_D)
    for t in range(pid, n_col * tl.cdiv(I, K_SPLIT), nprog):
        _prefetch_down_tile(wd_ptr, H, I, t % n_col, t // n_col, K_SPLIT, BLOCK_D, LINES_D)


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    # F32: Triton's CPU interpreter (tests) has no BF16 arithmetic; products of BF16 values are exact in FP32
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _swiglu(acc_g, acc_u, dt: tl.constexpr):
    # silu_mul's arithmetic on the GEMMs' rounded outputs
    gf = acc_g.to(dt).to(tl.float32)
    return ((gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _gate_up_tiles(h_ptr, wgu_ptr, act_ptr, M, I, H, pid, nprog, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                   F32: tl.constexpr, g0, u0, PRE: tl.constexpr):
    # PRE: g0 / u0 are the first K block of tile `pid`'s gate and up rows, loaded before the barrier
    offs_m = tl.arange(0, _BM)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    for t in range(pid, tl.cdiv(I, BLOCK_G), nprog):
        offs_n = t * BLOCK_G + tl.arange(0, BLOCK_G)
        n_ok = offs_n < I
        a_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * H + offs_k[None, :]
        g_ptrs = wgu_ptr + offs_n[:, None].to(tl.int64) * H + offs_k[None, :]
        u_ptrs = g_ptrs + I.to(tl.int64) * H
        acc_g = tl.zeros((_BM, BLOCK_G), dtype=tl.float32)
        acc_u = tl.zeros((_BM, BLOCK_G), dtype=tl.float32)
        k_lo = 0
        if PRE:
            if t == pid:
                a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < H), other=0.0, cache_modifier=".cg")
                acc_g = _dot(a, tl.trans(g0), acc_g, F32)
                acc_u = _dot(a, tl.trans(u0), acc_u, F32)
                k_lo = BLOCK_K
        a_ptrs += k_lo
        g_ptrs += k_lo
        u_ptrs += k_lo
        for k0 in range(k_lo, H, BLOCK_K):
            k_ok = offs_k < H - k0
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg")
            g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = _dot(a, tl.trans(g), acc_g, F32)
            acc_u = _dot(a, tl.trans(u), acc_u, F32)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        y = _swiglu(acc_g, acc_u, act_ptr.dtype.element_ty)
        tl.store(act_ptr + offs_m[:, None].to(tl.int64) * I + offs_n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _first_gu_block(wgu_ptr, I, H, t, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = t * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_k = tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < I) & (offs_k[None, :] < H)
    g_ptrs = wgu_ptr + offs_n[:, None].to(tl.int64) * H + offs_k[None, :]
    return tl.load(g_ptrs, mask=mask, other=0.0), tl.load(g_ptrs + I.to(tl.int64) * H, mask=mask, other=0.0)


@triton.jit
def _first_down_block(wd_ptr, H, I, t, K_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    n_col = tl.cdiv(H, BLOCK_D)
    offs_n = (t % n_col) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = (t // n_col) * K_SPLIT + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < H) & (offs_k[None, :] < I)
    return tl.load(wd_ptr + offs_n[:, None].to(tl.int64) * I + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _down_tile(act_ptr, wd_ptr, M, H, I, nt, s, K_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
               F32: tl.constexpr, w0, PRE: tl.constexpr):
    """FP32 act[:, split s] @ wd[column tile nt, split s]^T: [BLOCK_M, BLOCK_D]. PRE: w0 is its first K block."""
    offs_m = tl.arange(0, _BM)
    m_ok = offs_m < M
    offs_n = nt * BLOCK_D + tl.arange(0, BLOCK_D)
    n_ok = offs_n < H
    offs_k = s * K_SPLIT + tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * I + offs_k[None, :]
    w_ptrs = wd_ptr + offs_n[:, None].to(tl.int64) * I + offs_k[None, :]
    acc = tl.zeros((_BM, BLOCK_D), dtype=tl.float32)
    k_lo = 0
    if PRE:
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < I), other=0.0, cache_modifier=".cg")
        acc = _dot(a, tl.trans(w0), acc, F32)
        k_lo = BLOCK_K
    a_ptrs += k_lo
    w_ptrs += k_lo
    for k0 in range(k_lo, K_SPLIT, BLOCK_K):
        k_ok = offs_k < I - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg")
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(a, tl.trans(w), acc, F32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _down_tiles(act_ptr, wd_ptr, part_ptr, M, H, I, pid, nprog, K_SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_K: tl.constexpr, F32: tl.constexpr, w0, PRE: tl.constexpr):  # BLOCK_K: the down phase's own
    offs_m = tl.arange(0, _BM)
    n_col = tl.cdiv(H, BLOCK_D)
    for t in range(pid, n_col * tl.cdiv(I, K_SPLIT), nprog):
        nt = t % n_col
        s = t // n_col
        if PRE:  # the first tile's first K block came before the barrier
            if t == pid:
                acc = _down_tile(act_ptr, wd_ptr, M, H, I, nt, s, K_SPLIT, BLOCK_D, BLOCK_K, F32, w0, True)
            else:
                acc = _down_tile(act_ptr, wd_ptr, M, H, I, nt, s, K_SPLIT, BLOCK_D, BLOCK_K, F32, w0, False)
        else:
            acc = _down_tile(act_ptr, wd_ptr, M, H, I, nt, s, K_SPLIT, BLOCK_D, BLOCK_K, F32, w0, False)
        offs_n = nt * BLOCK_D + tl.arange(0, BLOCK_D)
        ws = part_ptr + s * M * H  # SPLITS * M * H < 2**31
        tl.store(ws + offs_m[:, None].to(tl.int64) * H + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < H))


@triton.jit(do_not_specialize=["M", "nprog", "first_layer", "last_layer"])
def _persistent_mlp(resid_ptr, h_ptr, act_ptr, part_ptr, norm_ptr, wgu_ptr, wd_ptr, bar_ptr, M, H, I, eps, nprog,
                    first_layer, last_layer, PHASE: tl.constexpr, SYNC: tl.constexpr, SPLITS: tl.constexpr,
                    K_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_KD: tl.constexpr, BLOCK_H: tl.constexpr, LINES_G: tl.constexpr, LINES_D: tl.constexpr, PREFETCH: tl.constexpr,
                    F32: tl.constexpr, WORK: tl.constexpr, PRELOAD: tl.constexpr):
    # PRELOAD (SYNC only): a program's first weight block of its next phase is read before the barrier ahead of it.
    # WORK: bit mask of the phases that compute (1 gate/up, 2 down, 4 norm); the others only pass their barriers
    # (benchmarks: the barriers' own cost). PHASE (SYNC=False only): -1 the first norm, 0 gate/up, 1 down, 2 norm with delta
    pid = tl.program_id(0)  # nprog: the grid's size (an argument: the CPU interpreter's num_programs is an array)
    arrivals = nprog * 0
    PRE: tl.constexpr = SYNC and PRELOAD
    wdt = wgu_ptr.dtype.element_ty
    g0 = tl.zeros((BLOCK_G, BLOCK_K), dtype=wdt)
    u0 = tl.zeros((BLOCK_G, BLOCK_K), dtype=wdt)
    w0 = tl.zeros((BLOCK_D, BLOCK_KD), dtype=wdt)
    if SYNC or PHASE == -1:
        if first_layer == 0:
            if SYNC and PREFETCH and WORK & 1:
                _prefetch_gu(wgu_ptr, I, H, pid, nprog, BLOCK_G, LINES_G)
            if WORK & 4:
                _norm_rows(resid_ptr, part_ptr, norm_ptr, h_ptr, M, H, eps, pid, nprog, False, SPLITS, BLOCK_H)
            if PRE:
                g0, u0 = _first_gu_block(wgu_ptr, I, H, pid, BLOCK_G, BLOCK_K)
            arrivals += nprog
            _grid_sync(bar_ptr, arrivals, SYNC)
    for layer in range(first_layer, last_layer):
        wgu = wgu_ptr + layer * (2 * H * I.to(tl.int64))
        wd = wd_ptr + layer * (H * I.to(tl.int64))
        if SYNC or PHASE == 0:
            if WORK & 1:
                _gate_up_tiles(h_ptr, wgu, act_ptr, M, I, H, pid, nprog, BLOCK_G, BLOCK_K, F32, g0, u0, PRE)
            if SYNC and PREFETCH and WORK & 2:
                _prefetch_down(wd, H, I, pid, nprog, K_SPLIT, BLOCK_D, LINES_D)
            if PRE:
                w0 = _first_down_block(wd, H, I, pid, K_SPLIT, BLOCK_D, BLOCK_KD)
            arrivals += nprog
            _grid_sync(bar_ptr, arrivals, SYNC)
        if SYNC or PHASE == 1:
            if WORK & 2:
                _down_tiles(act_ptr, wd, part_ptr, M, H, I, pid, nprog, K_SPLIT, BLOCK_D, BLOCK_KD, F32, w0, PRE)
            if SYNC and PREFETCH and WORK & 1 and layer + 1 < last_layer:
                _prefetch_gu(wgu + 2 * I * H, I, H, pid, nprog, BLOCK_G, LINES_G)
            arrivals += nprog
            _grid_sync(bar_ptr, arrivals, SYNC)
        if SYNC or PHASE == 2:
            if WORK & 4:
                _norm_rows(resid_ptr, part_ptr, norm_ptr + layer * H, h_ptr, M, H, eps, pid, nprog, True,
                           SPLITS, BLOCK_H)
            if layer + 1 < last_layer:
                if PRE:
                    g0, u0 = _first_gu_block(wgu + 2 * I * H, I, H, pid, BLOCK_G, BLOCK_K)
                arrivals += nprog
                _grid_sync(bar_ptr, arrivals, SYNC)


def barriers(layers: int) -> int:
    """Grid barriers one synchronized launch passes: the counter reads this times the programs afterwards."""
    return 3 * layers


def resident_programs(kernel, device: torch.device) -> int:
    """How many programs of a compiled kernel the GPU holds at once (registers, shared memory, SMs)."""
    if hasattr(kernel, "_init_handles"):
        kernel._init_handles()  # n_regs is known once the binary is loaded
    props = torch.cuda.get_device_properties(device)
    threads = kernel.metadata.num_warps * 32
    by_regs = props.regs_per_multiprocessor // max(1, kernel.n_regs * threads)
    smem = props.shared_memory_per_multiprocessor
    by_smem = smem // kernel.metadata.shared if kernel.metadata.shared else 32
    by_threads = props.max_threads_per_multi_processor // threads
    return props.multi_processor_count * max(0, min(by_regs, by_smem, by_threads, 32))


def checked_buffers(resid, norms, wgu, wd, splits: int, block_kd: int, name: str):
    """Validate the MLP chain's operands; (M, H, L, I, K split, splits, out h, act, FP32 partials) for a launch."""
    m, h = resid.shape
    layers, two_i, k = wgu.shape
    i = two_i // 2
    if m > BLOCK_M or k != h or wd.shape != (layers, h, i) or norms.shape != (layers, h):
        raise ValueError("shapes: resid [M<=64, H], norms [L, H], wgu [L, 2I, H], wd [L, H, I]")
    if not all(t.is_contiguous() for t in (resid, norms, wgu, wd)):
        raise ValueError(f"{name} needs contiguous tensors")
    k_split = triton.cdiv(triton.cdiv(i, splits), block_kd) * block_kd
    s = triton.cdiv(i, k_split)
    act = torch.empty((m, i), device=resid.device, dtype=resid.dtype)
    part = torch.empty((s, m, h), device=resid.device, dtype=torch.float32)
    return m, h, layers, i, k_split, s, torch.empty_like(resid), act, part


def launch_resident(kernel, args: tuple, programs: int, device: torch.device, **kw) -> None:
    """Compile `kernel` for these arguments, refuse a grid that cannot all be resident, launch it."""
    limit = resident_programs(kernel.warmup(*args, grid=(programs,), **kw), device)
    if programs > limit:
        raise ValueError(f"{programs} programs cannot all be resident (at most {limit} with this plan)")
    kernel[(programs,)](*args, **kw)


def persistent_mlp(resid: torch.Tensor, norms: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, eps: float,
                   programs: int, counter: torch.Tensor, splits: int = 4, block_g: int = 32, block_d: int = 32,
                   block_k: int = 128, block_kd: int = 256, num_warps: int = 4, num_stages: int = 2,
                   sync: bool = True, prefetch: bool = True, work: int = 7, preload: bool = False) -> torch.Tensor:
    """resid [M, H] (updated in place), norms [L, H], wgu [L, 2I, H] (gate rows then up rows), wd [L, H, I]
    -> h [M, H]: the MLP chain of L layers (module docstring). counter: int32 [1] on the device, zero before
    a synchronized launch; afterwards it reads barriers(L) * programs (less: the grid was not co-resident
    and the result is not valid). M <= 64. work: the phases that compute (module's WORK; 7 = all, the
    others leave the output undefined: for timing the barriers). preload: each program reads its next phase's
    first weight block before the barrier ahead of that phase (a synchronized launch only; same results).
    Raises ValueError when `programs` cannot all be resident."""
    m, h, layers, i, k_split, s, out, act, part = checked_buffers(resid, norms, wgu, wd, splits, block_kd,
                                                                  "persistent_mlp")
    kw = dict(SPLITS=s, K_SPLIT=k_split, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_K=block_k, BLOCK_KD=block_kd,
              BLOCK_H=triton.next_power_of_2(h), LINES_G=triton.next_power_of_2(triton.cdiv(h * 2, 128)),
              LINES_D=triton.next_power_of_2(triton.cdiv(k_split * 2, 128)), PREFETCH=prefetch and resid.is_cuda,
              F32=not resid.is_cuda, WORK=work, PRELOAD=preload, num_warps=num_warps, num_stages=num_stages)
    args = (resid, out, act, part, norms, wgu, wd, counter, m, h, i, eps, programs)
    if sync:
        if not resid.is_cuda:
            raise ValueError("a synchronized launch needs a GPU (the CPU interpreter runs programs one by one)")
        launch_resident(_persistent_mlp, args + (0, layers), programs, resid.device, PHASE=3, SYNC=True, **kw)
    else:
        _persistent_mlp[(programs,)](*args, 0, 0, PHASE=-1, SYNC=False, **kw)
        for layer in range(layers):
            for phase in (0, 1, 2):
                _persistent_mlp[(programs,)](*args, layer, layer + 1, PHASE=phase, SYNC=False, **kw)
    return out
