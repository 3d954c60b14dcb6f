"""A decode step's attention in one kernel: RoPE, the K/V cache write and paged attention (Triton).

In a decode step (one new token per sequence) the fused layer ran `rope_and_cache` (q, k rotated
out of the QKV GEMM's output, k and v into their cache slots) and then the paged-attention kernel:
two launches a layer, ~3 + ~7 us at 64 streams on an H200, mostly fixed cost. Here one program per
(sequence, kv head) does both: it sums the QKV GEMM's split-K partials for its kv group's G query
heads, its key and its value (plus the bias), rotates q and k, writes k and v to the token's slot,
and then attends over the sequence's cache exactly as `paged_attention` does (same tiles, same
online softmax, same order), so the output equals the two-kernel path bit for bit (tested).

The k and v written here are read back by the same program's attention loop; a block barrier
between the two makes its own global writes visible to all of its threads.

The kernel is bound by each program's serial chain of memory round trips, not by bandwidth (64
streams' keys are a few MB a layer). So (session 21) the first key tile's lines are asked into L2
before the PDL wait, while the QKV GEMM still runs: the cache's keys were written by earlier steps.
Measured and left out (session 21, docs/benchmarks/generate.md): loading that tile into registers
before the wait and joining the step's own key from registers (no barrier, no read-back) held up to
~250 registers a thread and was slower at both benchmark shapes, with or without the L2 prefetch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from surge.engines.kernels.pdl import launch_kw, prefetch_l2, wait_then_release
from surge.engines.kernels.splitk_gemm import sum_splits

# Launch shape of the kernel (warps, software-pipelining stages), measured by benchmarks/gpu_decode_attention.py
# (session 10, call 5: 64 streams, contexts 129-256, 256 keys a tile): 4 warps / 3 stages 6.58 us a layer,
# 8 / 3 6.93, 4 / 2 7.25; the bucket-64 decode graph 814.9 -> 802.7 us against 4 / 2.
LAUNCH = {"num_warps": 4, "num_stages": 3}

# Keys a tile in decode steps by head layout (query heads, kv heads, head size), measured by the same script
# with --shape: 256 where none is recorded (Qwen2-0.5B's 14 / 2 heads, the engine's default since session 7);
# Llama-1B's 32 / 8 heads at 128 (session 20, call 3: 12.55 us a layer with LAUNCH's 4 warps / 3 stages
# against 15.42 at 256 keys; docs/benchmarks/s20/call3/attn_llama.txt).
BLOCK_N = {(32, 8, 64): 128}
DEFAULT_BLOCK_N = 256

# The first key tile's lines asked into L2 before the PDL wait (the module docstring). Read at launch, so an
# engine's CUDA graphs keep the form they were captured with (benchmarks/generate_ab.py's "l2kv" variants).
# Session 21, call 2 (engine A/B, 7 rounds interleaved): Qwen2-0.5B decode graph 812.1 -> 796.1 us, 68,662 ->
# 70,333 tok/s; Llama-1B 1,200.2 -> 1,192.6 us, 45,011 -> 45,114 tok/s.
PREFETCH_FIRST_TILE = True


def block_n_for(nq: int, nkv: int, d: int) -> int:
    """Keys per iteration of decode steps for a head layout: the measured value, else DEFAULT_BLOCK_N."""
    return BLOCK_N.get((nq, nkv, d), DEFAULT_BLOCK_N)


@triton.jit
def _head_rows(qkv_ptr, bias_ptr, base, col, cols_p, mask, stride_s, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The GEMM output at columns `col` and their RoPE partners `cols_p` (the other half of the head):
    split-K partials summed in order plus the bias, in FP32 (the caller rounds once, where the BF16
    GEMM's epilogue rounds), or the GEMM's own output."""
    if SPLITS > 0:
        x = sum_splits(qkv_ptr + base + col, stride_s, mask, SPLITS)
        xp = sum_splits(qkv_ptr + base + cols_p, stride_s, mask, SPLITS)
        if HAS_BIAS:
            x += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
            xp += tl.load(bias_ptr + cols_p, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(qkv_ptr + base + col, mask=mask, other=0.0)
        xp = tl.load(qkv_ptr + base + cols_p, mask=mask, other=0.0)
    return x, xp


@triton.jit
def _rotate(x, xp, c, s, first):
    # the expressions of decoder_fused._rope_cache: a*c - b*s on the first half, b*c + a*s on the second
    a = x.to(tl.float32)
    b = xp.to(tl.float32)
    return tl.where(first, a * c - b * s, a * c + b * s)


@triton.jit
def _kv_tile(k_ptr, v_ptr, tables_ptr, seq, kvh, start, n_cached, offs_d, stride_kb, stride_kt, stride_kh, stride_tb,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys start .. start + BLOCK_N - 1 of the sequence's cache: (their positions, K [D, BLOCK_N], V [BLOCK_N, D]),
    zeros at positions >= n_cached."""
    kpos = start + tl.arange(0, BLOCK_N)
    kmask = kpos < n_cached
    blk = tl.load(tables_ptr + seq * stride_tb + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    kbase = blk * stride_kb + (kpos % PAGE) * stride_kt + kvh * stride_kh
    k = tl.load(k_ptr + kbase[None, :] + offs_d[:, None], mask=kmask[None, :], other=0.0)
    v = tl.load(v_ptr + kbase[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0)
    return kpos, k, v


@triton.jit
def _prefetch_tile(k_ptr, v_ptr, tables_ptr, seq, kvh, n_cached, stride_kb, stride_kt, stride_kh, stride_tb,
                   D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, LINE: tl.constexpr):
    """The 128-byte lines (LINE elements each) of the first BLOCK_N cached keys and values (positions < n_cached)
    asked into L2."""
    # positions past n_cached ask for the last cached key's lines again (position 0's block always exists)
    kpos = tl.minimum(tl.arange(0, BLOCK_N), tl.maximum(n_cached - 1, 0))
    blk = tl.load(tables_ptr + seq * stride_tb + kpos // PAGE).to(tl.int64)
    kbase = blk * stride_kb + (kpos % PAGE) * stride_kt + kvh * stride_kh
    if D <= LINE:
        prefetch_l2(k_ptr + kbase)
        prefetch_l2(v_ptr + kbase)
    else:
        line = tl.arange(0, D // LINE) * LINE
        prefetch_l2(k_ptr + kbase[:, None] + line[None, :])
        prefetch_l2(v_ptr + kbase[:, None] + line[None, :])


@triton.jit
def _attend(q, k, v, kpos, ctx, qk_scale, m_i, l_i, acc):
    """One tile of paged_attention's online softmax (n = 1: the query sees keys 0 .. ctx - 1)."""
    # ieee: an FP32 cache attends in FP32 (Triton's default for FP32 dots is TF32, which moved
    # logits by ~1e-3); BF16 / FP16 inputs ignore it
    sc = tl.dot(q, k, input_precision="ieee") * qk_scale
    sc = tl.where(kpos[None, :] < ctx, sc, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _decode_attn(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, ctx_ptr,
                 qk_scale, stride_t, stride_s, stride_kb, stride_kt, stride_kh, stride_ot, stride_oh, stride_tb,
                 NQ: tl.constexpr, NKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                 SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    dt = k_ptr.dtype.element_ty
    t = seq.to(tl.int64)  # a decode step: sequence i's one token is row i
    # the step's metadata is written before the step's first kernel: read it before the wait
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ctx = tl.load(ctx_ptr + seq)
    offs_d = tl.arange(0, D)
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    c = tl.load(cos_ptr + pos * D + offs_d).to(tl.float32)
    s = tl.load(sin_ptr + pos * D + offs_d).to(tl.float32)
    if PREFETCH:
        # the cache's keys were written by earlier steps (pdl.py's contract: nothing this step writes), so the
        # first tile's lines are asked into L2 before the wait, in the QKV GEMM's shadow
        _prefetch_tile(k_ptr, v_ptr, tables_ptr, seq, kvh, ctx - 1, stride_kb, stride_kt, stride_kh, stride_tb, D,
                       PAGE, BLOCK_N, LINE)
    wait_then_release(PDL)

    r = tl.arange(0, BLOCK_M)
    head = kvh * G + r
    rmask = r < G
    col = head[:, None] * D + offs_d[None, :]
    col_p = head[:, None] * D + partner[None, :]
    x, xp = _head_rows(qkv_ptr, bias_ptr, t * stride_t, col, col_p, rmask[:, None], stride_s, SPLITS, HAS_BIAS)
    q = _rotate(x.to(dt), xp.to(dt), c[None, :], s[None, :], first[None, :]).to(dt)
    q = tl.where(rmask[:, None], q, 0.0)

    kcol = (NQ + kvh) * D + offs_d
    kx, kxp = _head_rows(qkv_ptr, bias_ptr, t * stride_t, kcol, (NQ + kvh) * D + partner, offs_d < D, stride_s,
                         SPLITS, HAS_BIAS)
    k_new = _rotate(kx.to(dt), kxp.to(dt), c, s, first).to(dt)
    vcol = (NQ + NKV + kvh) * D + offs_d
    v_new, _ = _head_rows(qkv_ptr, bias_ptr, t * stride_t, vcol, vcol, offs_d < D, stride_s, SPLITS, HAS_BIAS)
    v_new = v_new.to(dt)
    dst = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_kt + kvh * stride_kh
    tl.store(k_ptr + dst + offs_d, k_new)
    tl.store(v_ptr + dst + offs_d, v_new)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    tl.debug_barrier()  # this program's k / v writes, visible to all its threads before the loop reads them
    # paged_attention's decode loop (n = 1): the one query token sees keys 0 .. ctx - 1
    for start in range(0, ctx, BLOCK_N):
        kpos, k, v = _kv_tile(k_ptr, v_ptr, tables_ptr, seq, kvh, start, ctx, offs_d, stride_kb, stride_kt, stride_kh,
                              stride_tb, PAGE, BLOCK_N)
        m_i, l_i, acc = _attend(q, k, v, kpos, ctx, qk_scale, m_i, l_i, acc)
    acc = acc / l_i[:, None]
    tl.store(o_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=rmask[:, None])


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                     nq: int, nkv: int, d: int, bias: torch.Tensor | None = None, block_n: int | None = None,
                     pdl: bool = False, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """A decode step (meta.max_query == 1: token i is sequence i's) -> attention output [T, nq, d].

    qkv: the QKV GEMM's output [T, (nq + 2 nkv) d], or its split-K partials [S, T, (nq + 2 nkv) d]
    (FP32) with the GEMM's `bias` still to add; cos / sin [max_pos, d]; caches [blocks, page, nkv, d],
    into which k and v of every token are written at `slots`. Equals `rope_and_cache` followed by
    `paged_attention(..., block_n=block_n)` (block_n: keys per iteration, default 64). num_warps / num_stages:
    the launch shape (default LAUNCH's)."""
    if meta.max_query != 1:
        raise ValueError("decode_attention serves decode steps (one new token per sequence)")
    splits = qkv.shape[0] if qkv.dim() == 3 else 0
    t = qkv.shape[-2]
    g = nq // nkv
    _, page, _, _ = k_cache.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, not {d}")
    # paged_attention's decode tiling: 16 rows when a kv group fits (the rows past G are masked)
    block_m = 16 if g <= 16 else triton.next_power_of_2(g)
    out = torch.empty((t, nq, d), device=qkv.device, dtype=k_cache.dtype)
    batch = meta.block_tables.shape[0]
    _decode_attn[(batch, nkv)](
        qkv, bias if bias is not None else qkv, cos, sin, positions, slots, k_cache, v_cache, out,
        meta.block_tables, meta.context_lens, scale * 1.4426950408889634,
        qkv.stride(-2), qkv.stride(0) if splits else 0, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        NQ=nq, NKV=nkv, G=g, D=d, PAGE=page, SPLITS=splits, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n or 64, PDL=pdl, PREFETCH=PREFETCH_FIRST_TILE, LINE=128 // k_cache.element_size(),
        num_warps=num_warps or LAUNCH["num_warps"], num_stages=num_stages or LAUNCH["num_stages"], **launch_kw(pdl))
    return out
