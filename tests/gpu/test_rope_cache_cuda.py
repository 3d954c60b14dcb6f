"""kernels/decoder_fused.rope_and_cache with many tokens a program (the prefill's layout since session 16): the
same bits as one token a program, and RoPE + the cache writes against an FP32 reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (8, 2, 128)])
@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("t", [1, 17, 255, 1000, 4099])
def test_tiled_rope_and_cache_equals_one_token_a_program(hq, hkv, d, splits, t):
    from surge.engines.kernels.decoder_fused import rope_and_cache

    dev, bf, page, nb = "cuda", torch.bfloat16, 16, 300
    g = torch.Generator().manual_seed(t * 10 + splits + d)
    width = (hq + 2 * hkv) * d
    if splits:
        qkv = (torch.randn(splits, t, width, generator=g) / splits ** 0.5).to(dev)
        bias = torch.randn(width, generator=g).to(dev, bf)
    else:
        qkv, bias = torch.randn(t, width, generator=g).to(dev, bf), None
    pos = torch.randint(0, 2000, (t,), generator=g).to(dev)
    slots = torch.randperm(nb * page, generator=g)[:t].to(dev)
    ang = torch.rand(2048, d // 2, generator=g, dtype=torch.float64) * 6.283
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dev, bf)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dev, bf)
    caches = torch.randn(2, nb, page, hkv, d, generator=g).to(dev, bf)
    outs = {}
    for bt in (1, 16, 64):
        k, v = caches[0].clone(), caches[1].clone()
        outs[bt] = (rope_and_cache(qkv, cos, sin, pos, slots, k, v, hq, hkv, d, bias=bias, block_t=bt), k, v)
    for bt in (16, 64):
        assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[bt])), bt
    # the reference: the rounded projection (partials summed in FP32, bias added, one rounding), rotated in FP32
    if splits:  # summed in split order, as the kernel does
        acc = qkv[0].clone()
        for i in range(1, splits):
            acc += qkv[i]
        x = (acc + bias.float()).to(bf)
    else:
        x = qkv
    x = x.float().view(t, hq + 2 * hkv, d)
    c, s = cos.float()[pos][:, None, : d // 2], sin.float()[pos][:, None, : d // 2]
    a, b = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([a * c - b * s, b * c + a * s], -1)
    q, k, v = outs[16]
    norm = (a * a + b * b).sqrt().clamp_min(1.0)  # each rotated pair's length
    tol = 2 ** -7 * torch.cat([norm, norm], -1)  # one BF16 rounding of the result, with room
    assert ((q.float() - rot[:, :hq]).abs() <= tol[:, :hq]).all()
    k_rows, v_rows = k.view(-1, hkv, d)[slots].float(), v.view(-1, hkv, d)[slots].float()
    assert ((k_rows - rot[:, hq:hq + hkv]).abs() <= tol[:, hq:hq + hkv]).all()
    assert torch.equal(v_rows, x[:, hq + hkv:])
    untouched = torch.ones(nb * page, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert torch.equal(k.view(-1, hkv, d)[untouched], caches[0].view(-1, hkv, d)[untouched])
    assert torch.equal(v.view(-1, hkv, d)[untouched], caches[1].view(-1, hkv, d)[untouched])
