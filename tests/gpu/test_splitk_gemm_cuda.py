"""The split-K GEMM of the decode step (engines/kernels/splitk_gemm.py) and the fused kernels that
read its partial sums: equal to a float64 product within BF16 rounding, every output written, and a
row's bits the same alone or in a batch (batch invariance)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda

# Qwen2-0.5B's and Llama-1B's layer GEMMs (N, K), and one whose K is no multiple of the tiles (masked last split)
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (3072, 2048), (2048, 2048), (2048, 8192), (200, 1000)]


def _plans(n, k):
    from surge.engines.kernels.splitk_gemm import SplitKPlan, default_plan, plan_for

    plans = [default_plan(n, k), SplitKPlan(64, 128, 7, num_stages=1), SplitKPlan(32, 64, 5, num_stages=3, swap=True),
             SplitKPlan(128, 64, 3, num_warps=8, num_stages=3), SplitKPlan(64, 256, 1, num_stages=2, swap=True)]
    measured = plan_for(n, k)
    return plans + ([measured] if measured is not None else [])


def _data(m, n, k, gen):
    # random, never zero (a zero input hides unwritten outputs and wrong indexing)
    a = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    return a, w


@pytest.mark.parametrize("n,k", SHAPES)
def test_splitk_equals_float64_matmul(n, k):
    from surge.engines.kernels.splitk_gemm import BLOCK_M, partials, reduce_partials

    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    for plan in _plans(n, k):
        for m in (1, 7, 33, 64, BLOCK_M + 5):
            a, w = _data(m, n, k, gen)
            bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
            ref = a.double() @ w.double().T
            s = plan.num_splits(k)
            ws = torch.full((s, m, n), float("nan"), device="cuda")  # poisoned: every element must be written
            part = partials(a, w, plan, out=ws)
            torch.cuda.synchronize()
            assert not part.isnan().any(), (plan, m)
            # FP32 sums of exact BF16 products: far under BF16's rounding
            err = ((part.double().sum(0) - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (plan, m, err)
            for b in (None, bias):
                out = reduce_partials(part, b, torch.bfloat16)
                want = ref + (b.double() if b is not None else 0.0)
                # one BF16 rounding of the FP32 sum: within half a BF16 ulp (2^-8 relative) plus FP32 slack
                tol = want.abs() * 2.0 ** -8 + 1e-5 * want.abs().max()
                bad = ((out.double() - want).abs() > tol).sum().item()
                assert bad == 0, (plan, m, b is not None, bad)


@pytest.mark.parametrize("n,k", SHAPES)
def test_splitk_rows_are_batch_invariant(n, k):
    """A row's product has the same bits alone, in a batch of 7, of 33 and of 64."""
    from surge.engines.kernels.splitk_gemm import linear

    gen = torch.Generator(device="cuda").manual_seed(k * 3 + n)
    for plan in _plans(n, k):
        a, w = _data(64, n, k, gen)
        full = linear(a, w, plan)
        for m in (1, 7, 33):
            part = linear(a[:m].contiguous(), w, plan)
            assert torch.equal(part, full[:m]), (plan, m)
        for i in (0, 17, 63):
            assert torch.equal(linear(a[i:i + 1].contiguous(), w, plan)[0], full[i]), (plan, i)


def test_fused_readers_equal_reduce_then_kernel():
    """add_rmsnorm, silu_mul and rope_and_cache on split-K partials give the bits of the same kernel
    on the reduced BF16 product (the GEMM output rounded where cuBLAS rounds it), for any batch size."""
    from surge.engines.kernels.decoder_fused import add_rmsnorm, rope_and_cache, silu_mul
    from surge.engines.kernels.splitk_gemm import SplitKPlan, partials, reduce_partials

    gen = torch.Generator(device="cuda").manual_seed(1)
    plan = SplitKPlan(64, 128, 7, num_stages=1)
    for m in (1, 7, 64):
        # o / down -> add_rmsnorm
        a, w = _data(m, 896, 896, gen)
        part = partials(a, w, plan)
        x0 = torch.randn(m, 896, generator=gen, device="cuda").to(torch.bfloat16)
        nw = torch.randn(896, generator=gen, device="cuda").to(torch.bfloat16)
        x1, x2 = x0.clone(), x0.clone()
        h1 = add_rmsnorm(x1, part, nw, 1e-6)
        h2 = add_rmsnorm(x2, reduce_partials(part), nw, 1e-6)
        assert torch.equal(x1, x2) and torch.equal(h1, h2), m
        # up_gate -> silu_mul
        a, w = _data(m, 2 * 4864, 896, gen)
        part = partials(a, w, plan)
        assert torch.equal(silu_mul(part, torch.bfloat16), silu_mul(reduce_partials(part))), m
        # qkv (+ bias) -> RoPE, q out, k and v into the cache
        nq, nkv, d = 14, 2, 64
        a, w = _data(m, (nq + 2 * nkv) * d, 896, gen)
        bias = torch.randn((nq + 2 * nkv) * d, generator=gen, device="cuda").to(torch.bfloat16)
        part = partials(a, w, plan)
        cos = torch.randn(512, d, generator=gen, device="cuda").to(torch.bfloat16)
        sin = torch.randn(512, d, generator=gen, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, 512, (m,), generator=gen, device="cuda")
        slots = torch.randperm(64 * 16, generator=gen, device="cuda")[:m]
        caches = [torch.full((64, 16, nkv, d), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        q1 = rope_and_cache(part, cos, sin, pos, slots, caches[0], caches[1], nq, nkv, d, bias=bias)
        q2 = rope_and_cache(reduce_partials(part, bias), cos, sin, pos, slots, caches[2], caches[3], nq, nkv, d)
        assert torch.equal(q1, q2), m
        for c1, c2 in ((caches[0], caches[2]), (caches[1], caches[3])):
            written = c1.view(-1, nkv, d)[slots]
            assert not written.isnan().any() and torch.equal(written, c2.view(-1, nkv, d)[slots]), m


def test_fused_readers_are_batch_invariant():
    """The decode path's readers of the partials: a row alone gives the bits of that row in a batch."""
    from surge.engines.kernels.decoder_fused import add_rmsnorm, silu_mul
    from surge.engines.kernels.splitk_gemm import SplitKPlan, partials

    gen = torch.Generator(device="cuda").manual_seed(2)
    plan = SplitKPlan(32, 64, 5, num_stages=3, swap=True)
    a, w = _data(64, 896, 4864, gen)
    x = torch.randn(64, 896, generator=gen, device="cuda").to(torch.bfloat16)
    nw = torch.randn(896, generator=gen, device="cuda").to(torch.bfloat16)
    xb = x.clone()
    hb = add_rmsnorm(xb, partials(a, w, plan), nw, 1e-6)
    for i in (0, 40):
        xi = x[i:i + 1].clone()
        hi = add_rmsnorm(xi, partials(a[i:i + 1].contiguous(), w, plan), nw, 1e-6)
        assert torch.equal(hi[0], hb[i]) and torch.equal(xi[0], xb[i]), i
    a, w = _data(64, 2 * 4864, 896, gen)
    full = silu_mul(partials(a, w, plan), torch.bfloat16)
    assert torch.equal(silu_mul(partials(a[5:6].contiguous(), w, plan), torch.bfloat16)[0], full[5])
