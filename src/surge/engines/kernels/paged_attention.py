"""Causal attention over a paged KV cache, for prefill chunks and decodes alike (Triton).

The step's queries are packed ([T, q_heads, D], sequence after sequence, offsets
in query_start); each sequence's keys and values are read block by block
through its block table ([B, max_blocks]), so nothing is gathered or padded.
Grouped-query attention is folded into the rows of a program: one program
serves one (sequence, kv head, tile of query tokens) and its rows are
`tokens x q_heads_per_kv`, so a decode of Qwen2-0.5B (7 query heads per kv head)
fills 7 of 16 rows with one read of the keys instead of seven. Query token r of
a sequence with n new tokens and context c sits at position c - n + r and sees
the keys up to it. Online softmax in fp32 (exp2 domain). The grid depends only
on (batch, kv heads, longest query), and context lengths are read from memory,
so a CUDA graph of a decode step serves any context length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attn(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, ctx_ptr, qstart_ptr, qk_scale,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ot, stride_oh, stride_tb,
                G: tl.constexpr, TOKS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q0 = tl.load(qstart_ptr + seq)
    n = tl.load(qstart_ptr + seq + 1) - q0
    ctx = tl.load(ctx_ptr + seq)
    if tile * TOKS >= n:
        return
    r = tl.arange(0, BLOCK_M)
    tok = tile * TOKS + r // G
    head = kvh * G + r % G
    rmask = (r < TOKS * G) & (tok < n)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    qrow = (q0 + tok).to(tl.int64)
    q = tl.load(q_ptr + qrow[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    qpos = ctx - n + tok
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = ctx - n + (tile + 1) * TOKS  # the tile's last query sees keys < end
    if end > ctx:
        end = ctx
    for start in range(0, end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < end
        blk = tl.load(tables_ptr + seq * stride_tb + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        kbase = blk * stride_kb + (kpos % PAGE) * stride_kt + kvh * stride_kh
        k = tl.load(k_ptr + kbase[None, :] + offs_d[:, None], mask=kmask[None, :] & dmask[:, None], other=0.0)
        # ieee: an FP32 cache attends in FP32 (Triton's default for FP32 dots is TF32, which moved
        # logits by ~1e-3); BF16 / FP16 inputs ignore it
        s = tl.dot(q, k, input_precision="ieee") * qk_scale
        s = tl.where((kpos[None, :] <= qpos[:, None]) & kmask[None, :], s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kbase[:, None] + offs_d[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(o_ptr + qrow[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    out: torch.Tensor | None = None, block_n: int | None = None, invariant: bool = False) -> torch.Tensor:
    """q [T, q_heads, D]; caches [blocks, page, kv_heads, D] (last dim contiguous); meta: AttnMeta
    (query_start, context_lens, block_tables on the device; max_query sizes the grid); block_n: keys
    per iteration of a decode step (default 64). invariant: the prefill tiling whatever max_query is, so
    a query row's bits follow its own sequence only (its tile is a function of its position; key tiles
    past its position add exact zeros), never what shares the step."""
    t, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    g = hq // hkv
    batch = meta.block_tables.shape[0]
    decode = meta.max_query == 1 and not invariant
    block_m = 16 if decode and g <= 16 else 64
    if g > block_m:
        block_m = triton.next_power_of_2(g)
    toks = block_m // g
    block_d = max(16, triton.next_power_of_2(d))
    block_n = (block_n or 64) if decode else 32
    out = torch.empty_like(q) if out is None else out
    grid = (batch, hkv, triton.cdiv(meta.max_query, toks))
    _paged_attn[grid](q, k_cache, v_cache, out, meta.block_tables, meta.context_lens, meta.query_start,
                      scale * 1.4426950408889634,
                      q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      out.stride(0), out.stride(1), meta.block_tables.stride(0),
                      G=g, TOKS=toks, D=d, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                      num_warps=4, num_stages=2)
    return out
