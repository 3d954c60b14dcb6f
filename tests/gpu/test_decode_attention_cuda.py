"""Session 10's decode-step kernels on a CUDA GPU: RoPE + K/V cache write + paged attention in one kernel
(kernels/decode_attention.py), and programmatic dependent launch (kernels/pdl.py) of the fused path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


def _decode_meta(ctxs, page, nb, dev):
    """A decode step's metadata (one new token per sequence, at position ctx - 1) over random blocks."""
    from tests.gpu.test_decoder_cuda import _meta

    meta = _meta([1] * len(ctxs), ctxs, page, nb, dev)
    meta.slot_mapping = torch.tensor([t[(c - 1) // page] * page + (c - 1) % page for t, c in zip(meta.tables, ctxs)],
                                     device=dev)
    return meta, torch.tensor([c - 1 for c in ctxs], device=dev)


def _pdl_modes():
    from surge.engines.kernels import pdl

    return [False, True] if pdl.supported() else [False]


# Each case is a compile of the kernel per (keys a tile, PDL); the engine's form (7 partials, the first tile
# asked into L2) runs every tile size with and without PDL, the others at the layout's own tile size only, so
# that the whole GPU suite stays inside one device call (session 21, call 3: 72 compiles timed it out).
_FORMS = [(7, True, (64, 128, 256), (False, True)), (0, True, None, (False, True)), (7, False, None, (True,))]


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (32, 8, 64), (12, 12, 64), (8, 2, 128)])
@pytest.mark.parametrize("splits,prefetch,block_ns,pdls", _FORMS)
def test_decode_attention_equals_rope_cache_then_paged_attention(hq, hkv, d, splits, prefetch, block_ns, pdls,
                                                                  monkeypatch):
    """Bit for bit: the attention output and both caches against rope_and_cache followed by
    paged_attention, on random Q/K/V (the GEMM's BF16 output, or 7 FP32 split-K partials plus a bias),
    contexts from 1 to 700 tokens (several 64-, 128- and 256-key iterations), with and without PDL, with
    and without the first key tile asked into L2 before the wait."""
    from surge.engines.kernels import decode_attention as da
    from surge.engines.kernels.decode_attention import decode_attention

    monkeypatch.setattr(da, "PREFETCH_FIRST_TILE", prefetch)
    from surge.engines.kernels.decoder_fused import rope_and_cache
    from surge.engines.kernels.paged_attention import paged_attention

    g = torch.Generator().manual_seed(hq * 1000 + splits)
    dev, page, nb, bf = "cuda", 16, 600, torch.bfloat16
    ctxs = [1, 2, 15, 16, 17, 63, 64, 65, 255, 256, 257, 300, 700, 31, 129, 1]
    torch.manual_seed(hq * 1000 + splits)
    meta, pos = _decode_meta(ctxs, page, nb, dev)
    t, width = len(ctxs), (hq + 2 * hkv) * d
    cache0 = torch.randn(nb, page, hkv, d, generator=g).to(dev, bf)
    vcache0 = torch.randn(nb, page, hkv, d, generator=g).to(dev, bf)
    if splits:
        qkv = torch.randn(splits, t, width, generator=g).to(dev) / splits ** 0.5
        bias = torch.randn(width, generator=g).to(dev, bf)
    else:
        qkv, bias = torch.randn(t, width, generator=g).to(dev, bf), None
    pos_table = torch.arange(1024, dtype=torch.float32)[:, None] * (10000.0 ** (-torch.arange(0, d, 2) / d))[None]
    emb = torch.cat([pos_table, pos_table], -1)
    cos, sin = emb.cos().to(dev, bf), emb.sin().to(dev, bf)
    scale = d ** -0.5
    for block_n in block_ns or (da.block_n_for(hq, hkv, d),):
        k_ref, v_ref = cache0.clone(), vcache0.clone()
        q = rope_and_cache(qkv, cos, sin, pos, meta.slot_mapping, k_ref, v_ref, hq, hkv, d, bias=bias)
        ref = paged_attention(q, k_ref, v_ref, meta, scale, block_n=block_n)
        for pdl in [p for p in _pdl_modes() if p in pdls] or [False]:
            k_c, v_c = cache0.clone(), vcache0.clone()
            out = decode_attention(qkv, cos, sin, pos, meta.slot_mapping, k_c, v_c, meta, scale, hq, hkv, d,
                                   bias=bias, block_n=block_n, pdl=pdl)
            assert torch.equal(k_c, k_ref) and torch.equal(v_c, v_ref), (block_n, pdl, "cache")
            assert torch.equal(out, ref), (block_n, pdl, (out.float() - ref.float()).abs().max().item())


def test_decode_attention_refuses_prefill():
    from surge.engines.kernels.decode_attention import decode_attention

    meta, pos = _decode_meta([5, 9], 16, 8, "cuda")
    meta.max_query = 2
    cache = torch.zeros(8, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="decode steps"):
        decode_attention(torch.zeros(2, 18 * 64, device="cuda", dtype=torch.bfloat16), cache[0, :, 0], cache[0, :, 0],
                         pos, meta.slot_mapping, cache, cache.clone(), meta, 0.125, 14, 2, 64)


def _chain(x0, w, pdl):
    """A decode layer's kernel chain without attention: add_rmsnorm -> split-K (one K step) ->
    add_rmsnorm reading the partials -> cuBLAS up_gate -> silu_mul -> split-K (several K steps) ->
    add_rmsnorm -> the argmax kernels. Every Triton kernel launched with PDL when asked."""
    from surge.engines.kernels.decoder_fused import add_rmsnorm, argmax_rows, silu_mul
    from surge.engines.kernels.splitk_gemm import partials, plan_for

    x = x0.clone()
    h = add_rmsnorm(x, None, w["n1"], 1e-6, pdl=pdl)
    h = add_rmsnorm(x, partials(h, w["o"], plan_for(896, 896), pdl=pdl), w["n2"], 1e-6, pdl=pdl)
    m = silu_mul(torch.nn.functional.linear(h, w["up_gate"]), pdl=pdl)
    h = add_rmsnorm(x, partials(m, w["down"], plan_for(896, 4864), pdl=pdl), w["n1"], 1e-6, pdl=pdl)
    return x, h, argmax_rows(h, block=256, pdl=pdl)


def test_pdl_chain_in_a_cuda_graph_equals_plain_launches():
    """The PDL launches captured in a CUDA graph and replayed on 30 fresh inputs give the plain
    launches' bits every time (a kernel reading its predecessor's output before it is complete, the
    race PDL invites, shows here as a mismatch); the weights read before each wait are Qwen2-0.5B's
    decode shapes (one K step for o, several for down)."""
    from surge.engines.kernels import pdl as pdl_mod

    if not pdl_mod.supported():
        pytest.skip("PDL needs compute capability >= 9 and a Triton with gdc_wait")
    g = torch.Generator().manual_seed(4)
    dev, bf = "cuda", torch.bfloat16
    w = {"o": torch.randn(896, 896, generator=g) / 30, "up_gate": torch.randn(9728, 896, generator=g) / 30,
         "down": torch.randn(896, 4864, generator=g) / 70, "n1": 1 + torch.rand(896, generator=g),
         "n2": 1 + torch.rand(896, generator=g)}
    w = {k: v.to(dev, bf) for k, v in w.items()}
    static = torch.randn(64, 896, generator=g).to(dev, bf)
    _chain(static, w, True)  # compile
    _chain(static, w, False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = _chain(static, w, True)
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(30):
        x0 = torch.randn(64, 896, generator=g).to(dev, bf)
        static.copy_(x0)
        graph.replay()
        want = _chain(x0, w, False)
        for a, b in zip(out, want):
            assert torch.equal(a, b), i
