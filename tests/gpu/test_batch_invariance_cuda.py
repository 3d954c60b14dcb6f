"""Batch invariance of the CUDA encoder (DESIGN.md: a result never depends on which other requests
shared its batch; the engine's default, batch_invariant): the one-tiling GEMM, the fixed attention
tile and the segmented mean give a row the same bits whatever the batch's size, longest sequence
or the row's place in it, and stay within rounding of float64; then the engine on the bundled
MiniLM: each sentence alone and among random neighbours, bit for bit, pooled and not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.types import TokenBatch
from tests.conftest import cosine_rows

pytestmark = pytest.mark.cuda

# rounding of one product of the dtype against float64, relative to the output's scale
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}


def _scaled_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_linear_invariant_rows_do_not_depend_on_the_batch(dtype):
    from surge.engines.kernels.gemm import ACT_GELU, linear_invariant

    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(dtype)  # noqa: E731
    for n, k, act in [(1152, 384, 0), (1536, 384, ACT_GELU), (384, 1536, 0), (37, 200, 0)]:
        w, b, rows = rnd(n, k), rnd(n), rnd(5, k)
        alone = torch.empty(5, n, dtype=dtype, device="cuda")
        for i in range(5):  # each row as a batch of one
            linear_invariant(rows[i:i + 1], w, b, alone[i:i + 1], act=act)
        want = rows.double() @ w.double().t() + b.double()
        if act == ACT_GELU:
            want = torch.nn.functional.gelu(want)
        assert _scaled_err(alone, want) <= TOL[dtype]
        for m in (5, 17, 64, 65, 300, 1024):
            big = rnd(m, k)
            at = torch.randperm(m, device="cuda", generator=gen)[:5]
            big[at] = rows
            out = torch.empty(m, n, dtype=dtype, device="cuda")
            linear_invariant(big, w, b, out, act=act)
            assert torch.equal(out[at], alone), f"{dtype} [{n} x {k}] rows moved in a batch of {m}"


def _attention_reference(q, k, v):
    s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_invariant_attention_does_not_follow_the_longest_sequence(dtype):
    from surge.engines.kernels.attention import varlen_attention

    heads, d = 12, 32
    hid = heads * d
    rng = np.random.default_rng()
    for length in (3, 10, 16, 40, 130):
        target = torch.randn(length, 3 * hid, device="cuda").to(dtype)

        def run(lengths, where, target=target):
            parts = [torch.randn(n, 3 * hid, device="cuda").to(dtype) for n in lengths]
            parts.insert(where, target)
            qkv = torch.cat(parts)
            sizes = [p.shape[0] for p in parts]
            cu = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device="cuda")
            out = torch.empty(qkv.shape[0], hid, dtype=dtype, device="cuda")
            varlen_attention(qkv, cu, out, heads, max(sizes), len(sizes), invariant=True)
            start = int(cu[where])
            return out[start:start + length]

        alone = run([], 0)
        q, k, v = (target[:, j * hid:(j + 1) * hid].reshape(length, heads, d).transpose(0, 1) for j in range(3))
        want = _attention_reference(q, k, v).transpose(0, 1).reshape(length, hid)
        assert _scaled_err(alone, want) <= TOL[dtype]
        for _ in range(6):
            others = rng.integers(1, 300, int(rng.integers(1, 8))).tolist()
            got = run(others, int(rng.integers(0, len(others) + 1)))
            assert torch.equal(got, alone), f"a {length}-token sequence moved beside {others}"


def test_segment_mean_does_not_depend_on_the_offset():
    from surge.engines.kernels.segment_mean import segment_mean

    rng = np.random.default_rng()
    h = 384
    for length in (1, 7, 16, 33, 250):
        seq = torch.randn(length, h, device="cuda").half()
        cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        alone = segment_mean(seq, cu, 1)
        want = seq.double().mean(0, keepdim=True)
        assert _scaled_err(alone, want) <= 1e-6
        for _ in range(6):
            before, after = int(rng.integers(0, 100)), int(rng.integers(0, 100))
            x = torch.cat([torch.randn(before, h, device="cuda").half(), seq, torch.randn(after, h, device="cuda").half()])
            cu = torch.tensor([0, before, before + length, before + length + after, before + length + after],
                              dtype=torch.int32, device="cuda")
            got = segment_mean(x, cu, 4)
            assert torch.equal(got[1:2], alone)
            assert float(got[3].abs().max()) == 0.0  # an empty sequence's mean is 0, not junk


def _engine(model_dir, precision, pooled, invariant=True):
    from surge.engines.torch_gpu import TorchEngine

    engine = TorchEngine(device="cuda", precision=precision, max_batch=64, max_tokens=8192,
                         batch_invariant=invariant)
    engine.load(model_dir)
    if pooled:
        assert engine.attach_pooling("mean")
    return engine


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_every_sentence_alone_equals_it_in_random_batches(model_dir, tokenizer, reference, sentences, precision):
    engine = _engine(model_dir, precision, pooled=True)
    assert engine.batch_invariant and engine.modes((1, 16, 16)) == ("invariant",)
    items = tokenizer.encode(sentences)
    alone = np.concatenate([engine.run(TokenBatch.pack([x])) for x in items])
    floor = 0.9999 if precision == "fp16" else 0.999
    assert cosine_rows(alone, reference).min() >= floor
    rng = np.random.default_rng()
    moved = []
    for _ in range(60):
        idx = rng.choice(len(items), int(rng.integers(2, 65)), replace=False)
        got = engine.run(TokenBatch.pack([items[i] for i in idx]))
        moved += [int(i) for i, g in zip(idx, got) if not np.array_equal(g, alone[i])]
    assert not moved, f"{precision}: {len(set(moved))} sentences' vectors changed with their batch"


def test_hidden_states_alone_equal_them_in_random_batches(model_dir, tokenizer, sentences):
    engine = _engine(model_dir, "fp16", pooled=False)
    items = tokenizer.encode(sentences[:120])
    alone = [engine.run(TokenBatch.pack([x])) for x in items]
    rng = np.random.default_rng()
    for _ in range(20):
        idx = rng.choice(len(items), int(rng.integers(2, 65)), replace=False)
        batch = TokenBatch.pack([items[i] for i in idx])
        got = engine.run(batch)
        cu = batch.cu_seqlens
        for j, i in enumerate(idx):
            np.testing.assert_array_equal(got[cu[j]:cu[j + 1]], alone[i])
