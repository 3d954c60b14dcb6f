"""FP8 activation rows for FP8 weights (engines/kernels/fp8_rows.py, the norm kernel's FP8 output): the row
quantization kernel and the norm's codes equal models/weight_quant.quantize_rows bit for bit; the FP8 GEMM
(cuBLASLt through torch._scaled_mm) within its roundings of the float64 product of the dequantized operands."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _hopper():
    from surge.engines.kernels import fp8_rows

    if not fp8_rows.supported():
        pytest.skip("FP8 products with row-wise scales need a Hopper-class GPU and torch._scaled_mm")


def _rows(m, k, seed):
    """Rows spanning magnitudes 1e-4..1e4, one with an outlier 1e3 times its others, one of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 4, m)[torch.randperm(m, generator=g)][:, None]
    x[0, k // 3] *= 1e3
    if m > 2:
        x[1] = 0
    return x.to("cuda", torch.bfloat16)


def _bits(q):
    return q.view(torch.uint8)


@pytest.mark.parametrize("m,k", [(1, 896), (37, 1000), (64, 4864), (5, 14336), (300, 2048)])
def test_quantize_rows_kernel_equals_torch(m, k):
    from surge.engines.kernels.fp8_rows import quantize_rows
    from surge.models.weight_quant import FP8_MAX
    from surge.models.weight_quant import quantize_rows as reference

    x = _rows(m, k, seed=m + k)
    q, s = quantize_rows(x)
    qr, sr = reference(x)
    assert q.dtype == qr.dtype and s.shape == (m, 1)
    assert torch.equal(_bits(q), _bits(qr)) and torch.equal(s, sr)
    # each row's largest |x| is the format's largest code, and the codes bring x back within E4M3's rounding
    nz = x.float().abs().amax(1) > 0
    assert torch.equal(q.float().abs().amax(1)[nz], torch.full((int(nz.sum()),), FP8_MAX, device="cuda"))
    back = q.float() * s
    assert ((back - x.float()).abs() <= x.float().abs() * 2 ** -4 + s * 2 ** -9).all()
    if m > 2:  # a row of zeros: codes 0 (its scale the floor's)
        assert not q[1].float().any()
    # a row's codes alone = in its batch
    i = m // 2
    qi, si = quantize_rows(x[i:i + 1])
    assert torch.equal(_bits(qi[0]), _bits(q[i])) and torch.equal(si[0], s[i])
    # a strided view of rows (a slice of a wider tensor) reads the right elements
    wide = torch.cat([x, x], dim=1)[:, :k]
    qw, sw = quantize_rows(wide)
    assert torch.equal(_bits(qw), _bits(q)) and torch.equal(sw, s)


@pytest.mark.parametrize("h", [896, 1000, 2048])
@pytest.mark.parametrize("delta_kind", ["none", "plain", "partials"])
@pytest.mark.parametrize("pdl", [False, True])
def test_add_rmsnorm_writes_the_rows_fp8_codes(h, delta_kind, pdl):
    """add_rmsnorm(fp8_out=True): the same output and residual bits as without, and the output's FP8 rows are
    quantize_rows(output) bit for bit."""
    from surge.engines.kernels import pdl as pdl_mod
    from surge.engines.kernels.decoder_fused import add_rmsnorm
    from surge.models.weight_quant import quantize_rows

    if pdl and not pdl_mod.supported():
        pytest.skip("PDL needs Hopper")
    g = torch.Generator().manual_seed(h)
    t = 64
    x = torch.randn(t, h, generator=g).to("cuda", torch.bfloat16)
    w = (torch.rand(h, generator=g) * 2).to("cuda", torch.bfloat16)
    delta = None if delta_kind == "none" else \
        torch.randn(t, h, generator=g).to("cuda", torch.bfloat16) if delta_kind == "plain" else \
        torch.randn(3, t, h, generator=g).to("cuda")
    x1, x2 = x.clone(), x.clone()
    want = add_rmsnorm(x1, delta, w, 1e-6, pdl=pdl)
    got, (q, s) = add_rmsnorm(x2, delta, w, 1e-6, pdl=pdl, fp8_out=True)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(x2, x1)
    qr, sr = quantize_rows(want)
    assert torch.equal(_bits(q), _bits(qr)) and torch.equal(s, sr)


@pytest.mark.parametrize("n,k", [(1152, 896), (896, 4864), (3072, 2048), (9728, 896)])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_scaled_linear_within_its_roundings_of_float64(n, k, m):
    """The FP8 GEMM of FP8 rows and an FP8 weight, row-wise scales, BF16 out (+ a bias after): each element within
    one BF16 rounding of the float64 product of the dequantized operands plus the FP32 sums' error (bounded by the
    sum of |a_k w_k|); a row alone within the same bound of itself in the batch."""
    from surge.engines.kernels.fp8_rows import quantize_rows, scaled_linear
    from surge.models.weight_quant import quantize

    g = torch.Generator().manual_seed(n + k + m)
    w = (torch.randn(n, k, generator=g) / k ** 0.5 * (torch.rand(n, 1, generator=g) * 4 + 0.1)).to("cuda")
    wq, ws = quantize(w.to(torch.bfloat16), "fp8")
    x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=g).to("cuda", torch.bfloat16)
    xq, xs = quantize_rows(x)
    a, b = xq.double() * xs.double(), wq.double() * ws.double()[:, None]
    ref = a @ b.T
    bound = ref.abs() * 2 ** -8 + (a.abs() @ b.abs().T) * 2e-3 + 1e-30
    got = scaled_linear(xq, xs, wq, ws).double()
    assert ((got - ref).abs() <= bound).all(), ((got - ref).abs() / bound).max().item()
    with_bias = scaled_linear(xq, xs, wq, ws, bias=bias).double()
    assert ((with_bias - (ref + bias.double())).abs() <= bound + (ref + bias.double()).abs() * 2 ** -8).all()
    i = m // 2
    alone = scaled_linear(xq[i:i + 1], xs[i:i + 1], wq, ws).double()[0]
    assert ((alone - ref[i]).abs() <= bound[i]).all()


def test_fits_and_the_probe(monkeypatch):
    """fits: both dimensions multiples of 16. The probe says no where torch._scaled_mm raises (a torch or GPU
    without row-wise FP8 scales) or answers wrong, and yes again with the real one."""
    from surge.engines.kernels import fp8_rows

    assert fp8_rows.fits(1152, 896) and not fp8_rows.fits(200, 1000) and not fp8_rows.fits(1000, 896)
    real = torch._scaled_mm

    def raises(*args, **kw):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    def wrong(*args, **kw):
        return real(*args, **kw) * 2

    try:
        for fake in (raises, wrong):
            fp8_rows.supported.cache_clear()
            monkeypatch.setattr(torch, "_scaled_mm", fake)
            assert not fp8_rows.supported(), fake.__name__
    finally:
        monkeypatch.setattr(torch, "_scaled_mm", real)
        fp8_rows.supported.cache_clear()
    assert fp8_rows.supported()
