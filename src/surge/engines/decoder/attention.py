"""Attention over the paged KV cache: metadata of a step and the plain-torch path.

A step's tokens are packed ([T, heads, dim], sequences one after another); each
sequence's keys and values live in the blocks its block table names. The CPU
path gathers a sequence's blocks and runs SDPA with a causal mask shifted by the
tokens already cached; the GPU path is one Triton kernel for prefill chunks and
decodes alike (engines/kernels/paged_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32: cached + new tokens of each sequence
    query_start: torch.Tensor  # [B+1] int32: packed offsets of each sequence's new tokens
    max_query: int
    # host copies for the torch path (no device sync)
    q_lens: list[int]
    ctx_lens: list[int]
    tables: list[list[int]]
    # rows of one sequence at consecutive positions (a speculative step's drafts, one row each): every
    # row's K/V must be in the cache before any row attends, so the step's kernels write them first
    rows_share_kv: bool = False


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k_cache [num_blocks, block_size, kv_heads, dim]; k [T, kv_heads, dim]."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                          scale: float) -> torch.Tensor:
    """q [T, heads, dim] -> [T, heads, dim]. A decode step (one new token per sequence, several
    sequences) runs batched over the sequences; anything else sequence by sequence."""
    if len(meta.q_lens) > 1 and meta.max_query == 1:
        return _decode_batched(q, k_cache, v_cache, meta, scale)
    return paged_attention_loop(q, k_cache, v_cache, meta, scale)


def decode_gather(meta: AttnMeta, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots [B, longest context] of every sequence's keys, and which of them are real."""
    width = max(meta.ctx_lens)
    blocks = -(-width // block_size)
    tables = torch.zeros(len(meta.tables), blocks, dtype=torch.long)
    for row, table in enumerate(meta.tables):
        n = min(blocks, len(table))
        tables[row, :n] = torch.as_tensor(table[:n], dtype=torch.long)
    pos = torch.arange(width)
    slots = tables[:, pos // block_size] * block_size + pos % block_size
    valid = pos[None, :] < torch.as_tensor(meta.ctx_lens)[:, None]
    return slots.masked_fill(~valid, 0).to(device), valid.to(device)


def _decode_batched(q, k_cache, v_cache, meta: AttnMeta, scale: float) -> torch.Tensor:
    # The sequence loop costs ~10 small ops per sequence per layer; here one gather of K and one of V
    # per layer and one SDPA call. The slots and the gather buffers are the same for every layer of
    # a step: made once and kept on the metadata (fresh 2-5 MB buffers per layer page-faulted:
    # 19.6 against 7.2 ms a step for 8 GPT-2 streams of ~90 tokens on the 2-core CPU), and
    # index_select into them, 3x faster than advanced indexing with a 2-D index. Against the loop:
    # 16.8 -> 8.3 ms a step for 12 layers (benchmarks/cpu_parts.py).
    # On the CPU a BF16 / FP16 cache is attended in FP32: torch's CPU SDPA is several times slower in BF16
    # at these shapes, and the exact upcast of the gathered K/V costs less than it saves (12 layers of 8
    # GPT-2 streams of ~120 positions, 2 cores: 13.8 -> 7.4 ms, benchmarks/cpu_parts.py, session 34); the
    # output is rounded back to the activations' dtype.
    upcast = k_cache.device.type == "cpu" and k_cache.dtype in (torch.bfloat16, torch.float16)
    bs, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    scratch = getattr(meta, "_decode_scratch", None)
    if scratch is None:
        slots, valid = decode_gather(meta, bs, q.device)
        n = slots.numel()
        scratch = (slots.reshape(-1), valid[:, None, None, :], slots.shape,
                   k_cache.new_empty(n, kvh, d), v_cache.new_empty(n, kvh, d),
                   (torch.empty(n, kvh, d), torch.empty(n, kvh, d)) if upcast else None)
        object.__setattr__(meta, "_decode_scratch", scratch)
    flat, mask, (b, width), kbuf, vbuf, wide = scratch
    torch.index_select(k_cache.view(-1, kvh, d), 0, flat, out=kbuf)
    torch.index_select(v_cache.view(-1, kvh, d), 0, flat, out=vbuf)
    if wide is not None:
        kbuf, vbuf = wide[0].copy_(kbuf), wide[1].copy_(vbuf)
    k = kbuf.view(b, width, kvh, d).transpose(1, 2)  # [B, kv_heads, L, dim], no copy
    v = vbuf.view(b, width, kvh, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None, :].to(k.dtype), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != kvh)
    return out[:, :, 0, :].to(q.dtype)


def paged_attention_loop(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                         scale: float) -> torch.Tensor:
    """The sequence-by-sequence path (prefill chunks, mixed steps); also the batched path's reference."""
    bs = k_cache.shape[1]
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    start = 0
    for n, ctx, table in zip(meta.q_lens, meta.ctx_lens, meta.tables):
        blocks = torch.as_tensor(table[: -(-ctx // bs)], dtype=torch.long, device=q.device)
        k = k_cache.index_select(0, blocks).reshape(-1, kvh, d)[:ctx].transpose(0, 1)
        v = v_cache.index_select(0, blocks).reshape(-1, kvh, d)[:ctx].transpose(0, 1)
        qi = q[start:start + n].transpose(0, 1)
        mask = None
        if n > 1:
            # query row r sits at position ctx - n + r and sees keys up to it
            mask = torch.arange(ctx, device=q.device)[None, :] <= (ctx - n + torch.arange(n, device=q.device))[:, None]
        if q.shape[1] != kvh:  # grouped-query: each kv head serves q_heads / kv_heads query heads
            g = q.shape[1] // kvh
            k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
        # plain matmuls: at these sizes (one sequence's step) they beat SDPA's CPU dispatch by ~10x
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
        out[start:start + n] = o.transpose(0, 1)
        start += n
    return out


class DenseMeta:
    """A forward without a KV cache (a decoder serving embeddings): packed sequences [T], each attending
    to its own earlier tokens only. Sequences share SDPA blocks as the encoder's CPU path packs them
    (encoder_cpu.AttentionPlan, with a causal mask): one attention call a layer for the batch."""

    def __init__(self, lens: list[int], device):
        from surge.engines.encoder_cpu import AttentionPlan

        self.lens = list(lens)
        self.plan = AttentionPlan(np.asarray(self.lens), causal=True)
        self.index = self.mask = None
        if not self.plan.single:  # each packed token's row in the blocks [blocks * P]
            offsets = np.concatenate([np.arange(n) for n in self.plan.fill])
            rows = np.repeat(np.arange(len(self.plan.fill)) * self.plan.block, self.plan.fill) + offsets
            self.index = torch.as_tensor(rows, device=device)
            self.mask = self.plan.mask.to(device)


class PaddedMeta:
    """A forward without a KV cache over `rows` right-padded sequences of `width` tokens ([rows * width]
    tokens): causal attention alone keeps every real token off the padding (it comes after them), so
    the shapes are all the batch needs and a CUDA graph captures it once (engines/decoder/embedder.py)."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self.lens = [width] * rows


class _KernelMeta:
    """What kernels/paged_attention.paged_attention reads of a step, for a forward without a cache."""

    def __init__(self, lens: list[int], device):
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        width = max(lens)
        tables = np.zeros((len(lens), width), dtype=np.int32)
        for i, n in enumerate(lens):
            tables[i, :n] = starts[i] + np.arange(n, dtype=np.int32)
        self.block_tables = torch.as_tensor(tables, device=device)
        self.context_lens = torch.as_tensor(np.asarray(lens, dtype=np.int32), device=device)
        self.query_start = torch.as_tensor(starts, device=device)
        self.max_query = width


def causal_dense_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """causal_dense, batch invariant (CUDA): the paged attention kernel in its fixed tiling over the step's own
    K/V as a cache of one-token pages (a sequence's table: its rows in order), so a token's output follows its
    own sequence only. SDPA's kernels pick tiles and splits by the batch's shape. The kernel's tables are
    built once per meta (a CUDA graph's meta keeps them for its replays)."""
    from surge.engines.kernels.paged_attention import paged_attention

    km = getattr(meta, "_kernel", None)
    if km is None:
        km = meta._kernel = _KernelMeta(meta.lens, q.device)
    t, hkv, d = k.shape
    return paged_attention(q, k.view(t, 1, hkv, d), v.view(t, 1, hkv, d), km, scale, invariant=True)


def causal_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """q [T, heads, dim], k and v [T, kv_heads, dim] of the packed (DenseMeta) or padded (PaddedMeta)
    sequences -> [T, heads, dim]."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(meta, PaddedMeta):
        b, w = meta.rows, meta.width
        out = F.scaled_dot_product_attention(*(x.view(b, w, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v)),
                                             is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(q.shape)
    if meta.plan.single:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    n, p = len(meta.plan.fill), meta.plan.block

    def blocks(x):  # [T, h, d] -> [blocks, h, P, d]; padding rows are zeros the mask keeps to themselves
        out = x.new_zeros(n * p, x.shape[1], x.shape[2]).index_copy_(0, meta.index, x)
        return out.view(n, p, x.shape[1], x.shape[2]).transpose(1, 2)

    out = F.scaled_dot_product_attention(blocks(q), blocks(k), blocks(v), attn_mask=meta.mask, scale=scale,
                                         enable_gqa=gqa)
    return out.transpose(1, 2).reshape(n * p, q.shape[1], q.shape[2]).index_select(0, meta.index)
