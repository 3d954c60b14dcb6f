"""The CPU paged attention: a decode step batched over sequences equals the sequence loop; a BF16 / FP16 cache
is attended in FP32 (torch's CPU SDPA is several times slower in BF16) and is as close to float64 as BF16 allows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.decoder.attention import AttnMeta, paged_attention_loop, paged_attention_torch


def _meta(ctx_lens, q_lens, block_size, num_blocks, rng):
    free = list(rng.permutation(num_blocks))
    tables = [[int(free.pop()) for _ in range(-(-c // block_size))] for c in ctx_lens]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    slots = [t[(c - n + j) // block_size] * block_size + (c - n + j) % block_size
             for t, c, n in zip(tables, ctx_lens, q_lens) for j in range(n)]
    return AttnMeta(slot_mapping=torch.tensor(slots), block_tables=bt, context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
                    query_start=torch.from_numpy(starts), max_query=max(q_lens), q_lens=list(q_lens),
                    ctx_lens=list(ctx_lens), tables=tables)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_a_batched_decode_step_equals_the_sequence_loop(heads, kv_heads):
    rng = np.random.default_rng()
    block, dim, n_blocks = 16, 32, 64
    ctx = [int(c) for c in rng.integers(1, 120, size=int(rng.integers(2, 9)))]
    meta = _meta(ctx, [1] * len(ctx), block, n_blocks, rng)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    kc = torch.randn(n_blocks, block, kv_heads, dim, generator=g, dtype=torch.float64)
    vc = torch.randn(n_blocks, block, kv_heads, dim, generator=g, dtype=torch.float64)
    q = torch.randn(len(ctx), heads, dim, generator=g, dtype=torch.float64)
    got = paged_attention_torch(q, kc, vc, meta, dim ** -0.5)
    want = paged_attention_loop(q, kc, vc, meta, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)  # both take the softmax in float32
    # and against attention written out in float64 for one sequence, from its own blocks
    b = int(rng.integers(len(ctx)))
    keys = torch.cat([kc[t] for t in meta.tables[b]])[: ctx[b]].repeat_interleave(heads // kv_heads, dim=1)
    vals = torch.cat([vc[t] for t in meta.tables[b]])[: ctx[b]].repeat_interleave(heads // kv_heads, dim=1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q[b], keys) * dim ** -0.5, dim=-1)
    torch.testing.assert_close(got[b], torch.einsum("hl,lhd->hd", p, vals), rtol=2e-5, atol=1e-6)  # both take the softmax in float32


def test_a_prefill_or_a_single_sequence_takes_the_loop():
    rng = np.random.default_rng()
    meta = _meta([20, 7], [5, 1], 16, 16, rng)  # a prefill chunk beside a decode: the loop
    kc = torch.randn(16, 16, 2, 8, dtype=torch.float64)
    vc = torch.randn(16, 16, 2, 8, dtype=torch.float64)
    q = torch.randn(6, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(paged_attention_torch(q, kc, vc, meta, 0.3), paged_attention_loop(q, kc, vc, meta, 0.3))
    assert getattr(meta, "_decode_scratch", None) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_decode_step_is_attended_in_fp32(dtype):
    """The batched step on a BF16 / FP16 cache: within one rounding of its dtype of float64 attention over the same
    (rounded) inputs, at least as close as the sequence loop's half-precision SDPA, and in the cache's dtype."""
    rng = np.random.default_rng()
    block, dim, n_blocks, heads, kv_heads = 16, 64, 96, 12, 4
    ctx = [int(c) for c in rng.integers(20, 200, size=8)]
    meta = _meta(ctx, [1] * len(ctx), block, n_blocks, rng)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    kc = torch.randn(n_blocks, block, kv_heads, dim, generator=g).to(dtype)
    vc = torch.randn(n_blocks, block, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(len(ctx), heads, dim, generator=g).to(dtype)
    got = paged_attention_torch(q, kc, vc, meta, dim ** -0.5)
    assert got.dtype == dtype and getattr(meta, "_decode_scratch")[-1] is not None
    want = paged_attention_loop(q.double(), kc.double(), vc.double(), meta, dim ** -0.5)
    err = (got.double() - want).abs().max().item()
    loop_err = (paged_attention_loop(q, kc, vc, meta, dim ** -0.5).double() - want).abs().max().item()
    eps = torch.finfo(dtype).eps
    assert err <= eps * want.abs().max().item(), (err, eps)
    assert err <= loop_err * 1.01 + 1e-6, (err, loop_err)
