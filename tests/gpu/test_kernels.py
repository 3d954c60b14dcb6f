"""Each Triton kernel against float64 math on fresh random inputs, outputs poisoned with NaN first."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.cuda

DTYPES = [torch.float16, torch.bfloat16]


def _tol(dtype):
    return 4e-3 if dtype == torch.float16 else 2e-2


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "an output element was never written (NaN poison left)"
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,d", [(12, 32), (12, 64), (3, 20)])
def test_varlen_attention(dtype, heads, d):
    from surge.engines.kernels.attention import varlen_attention

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    lengths = [1, 7, 33, 64, 65, 130, 257, 3]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t, hid = cu[-1], heads * d
    qkv = (torch.randn(t, 3 * hid, generator=g) * 2).to("cuda", dtype)
    # grid sized like a CUDA-graph bucket: more sequences (empty ones) and a longer max length than needed
    cu_dev = torch.tensor(cu + [t] * 5, dtype=torch.int32, device="cuda")
    out = torch.full((t, hid), float("nan"), dtype=dtype, device="cuda")
    varlen_attention(qkv, cu_dev, out, heads, max_len=512, batch=len(lengths) + 5)
    q64 = qkv.double()
    ref = torch.empty(t, hid, dtype=torch.float64, device="cuda")
    for s, e in zip(cu[:-1], cu[1:]):
        q, k, v = (q64[s:e, j * hid:(j + 1) * hid].reshape(e - s, heads, d).transpose(0, 1) for j in range(3))
        p = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), -1)
        ref[s:e] = (p @ v).transpose(0, 1).reshape(e - s, hid)
    assert _rel(out, ref) < _tol(dtype)
    # in place over Q, as the encoder runs it: K and V must stay untouched
    kv = qkv[:, hid:].clone()
    varlen_attention(qkv, cu_dev, qkv[:, :hid], heads, max_len=512, batch=len(lengths) + 5)
    assert _rel(qkv[:, :hid], ref) < _tol(dtype)
    assert torch.equal(qkv[:, hid:], kv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [384, 768, 1000])
def test_add_layernorm_aliasing_residual(dtype, n):
    from surge.engines.kernels.norm import add_layernorm

    rows = 37
    a = torch.randn(rows, n, device="cuda", dtype=dtype)
    bias, w, b = (torch.randn(n, device="cuda", dtype=dtype) for _ in range(3))
    res = torch.randn(rows, n, device="cuda", dtype=dtype)
    ref = torch.nn.functional.layer_norm(a.double() + bias.double() + res.double(), (n,), w.double(), b.double(), 1e-12)
    out = res  # written in place over the residual, as the encoder does
    add_layernorm(a, bias, res, w, b, 1e-12, out=out)
    assert _rel(out, ref) < _tol(dtype)
    out2 = torch.full_like(a, float("nan"))
    res2 = torch.randn_like(a)
    add_layernorm(a, bias, res2, w, b, 1e-5, out=out2)
    ref2 = torch.nn.functional.layer_norm(a.double() + bias.double() + res2.double(), (n,), w.double(), b.double(), 1e-5)
    assert _rel(out2, ref2) < _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_layernorm(dtype):
    from surge.engines.kernels.norm import embed_layernorm

    n, vocab, rows = 384, 999, 53
    word, posw = torch.randn(vocab, n, device="cuda", dtype=dtype), torch.randn(130, n, device="cuda", dtype=dtype)
    typew = torch.randn(2, n, device="cuda", dtype=dtype)
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    ids = torch.randint(0, vocab, (rows,), device="cuda", dtype=torch.int32)
    types = torch.randint(0, 2, (rows,), device="cuda", dtype=torch.int32)
    pos = torch.randint(0, 130, (rows,), device="cuda", dtype=torch.int32)
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
    embed_layernorm(ids, types, pos, word, posw, typew, w, b, 1e-12, out=out)
    x = word.double()[ids.long()] + posw.double()[pos.long()] + typew.double()[types.long()]
    ref = torch.nn.functional.layer_norm(x, (n,), w.double(), b.double(), 1e-12)
    assert _rel(out, ref) < _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tanh", [False, True])
@pytest.mark.parametrize("n", [1536, 3072, 1001])
def test_bias_gelu(dtype, tanh, n):
    from surge.engines.kernels.norm import bias_gelu_

    rows = 19
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 3
    bias = torch.randn(n, device="cuda", dtype=dtype)
    ref = torch.nn.functional.gelu(x.double() + bias.double(), approximate="tanh" if tanh else "none")
    bias_gelu_(x, bias, tanh=tanh)
    assert _rel(x, ref) < _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (33, 2304, 768), (77, 768, 3072), (1500, 3072, 768), (19, 1001, 130)])
@pytest.mark.parametrize("act", [0, 1, 2])
def test_gemm_epilogues(dtype, m, n, k, act):
    from surge.engines.kernels.gemm import linear

    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=dtype) if act != 2 or m % 2 else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    linear(a, w, bias, out, act=act)
    ref = a.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    if act:
        ref = torch.nn.functional.gelu(ref, approximate="tanh" if act == 2 else "none")
    assert _rel(out, ref) < _tol(dtype)

