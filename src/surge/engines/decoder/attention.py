"""Attention over the paged KV cache: metadata of a step and the plain-torch path.

A step's tokens are packed ([T, heads, dim], sequences one after another); each
sequence's keys and values live in the blocks its block table names. The CPU
path gathers a sequence's blocks and runs SDPA with a causal mask shifted by the
tokens already cached; the GPU path is one Triton kernel for prefill chunks and
decodes alike (engines/kernels/paged_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k_cache [num_blocks, block_size, kv_heads, dim]; k [T, kv_heads, dim]."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                          scale: float) -> torch.Tensor:
    """q [T, heads, dim] -> [T, heads, dim]."""
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
