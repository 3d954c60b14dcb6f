"""SiLU(gate) * up with the (tile, K step) units dealt evenly over the SMs (kernels/gate_up_streamk.py) on a
CUDA GPU: against float64 and the one-tile-a-program kernel on fresh random inputs, tiles cut between 2-7
programs, bits independent of the batch, of PDL and of repeats, counters back at zero, CUDA graph replays."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


def _ref(x, w):
    i = w.shape[0] // 2
    g = (x.double() @ w[:i].double().T).to(x.dtype).double()
    u = (x.double() @ w[i:].double().T).to(x.dtype).double()
    return g * torch.sigmoid(g) * u


def _weights(i, k, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2 * i, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16), g


@pytest.mark.parametrize("i,k,programs", [(4864, 896, 0), (4864, 896, 100), (8192, 2048, 0), (512, 200, 0),
                                          (256, 896, 9)])
def test_streamk_against_float64_and_the_tile_kernel(i, k, programs):
    """M of 1 to 64 rows: within BF16 rounding of float64, as close as the one-tile-a-program kernel, whose
    output it equals but for the last bits; no NaN; the counters end at zero."""
    from surge.engines.kernels import gate_up_streamk as sk
    from surge.engines.kernels.gate_up import GateUpPlan, gate_up_silu

    w, g = _weights(i, k, i + k + programs)
    plan = sk.StreamKPlan(programs=programs)
    tiles, ksteps, p, pieces = sk._grid(w, plan)
    assert pieces >= 2, "the case must cut tiles between programs"
    ws, counters = sk.workspace(w, plan)
    for m in (1, 7, 33, 64):
        x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
        ref = _ref(x, w)
        tile = gate_up_silu(x, w, GateUpPlan(64, 128, tma=True))
        out = sk.gate_up_silu_streamk(x, w, plan, ws, counters)
        assert out.shape == (m, i) and not out.isnan().any()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        tile_err = ((tile.double() - ref).norm() / ref.norm()).item()
        assert err < max(1.5 * tile_err, 2e-3), (m, err, tile_err)
        close = (out.double() - tile.double()).abs() <= 2 * 2 ** -8 * tile.double().abs() + 1e-6
        assert close.float().mean().item() > 0.999, (m, close.float().mean().item())
        assert int(counters.abs().sum()) == 0


def test_streamk_bits_do_not_depend_on_batch_pdl_or_repeats():
    from surge.engines.kernels import gate_up_streamk as sk
    from surge.engines.kernels import pdl

    w, g = _weights(4864, 896, 3)
    plan = sk.StreamKPlan()
    ws, counters = sk.workspace(w, plan)
    x = torch.randn(64, 896, generator=g).to("cuda", torch.bfloat16)
    full = sk.gate_up_silu_streamk(x, w, plan, ws, counters)
    assert torch.equal(sk.gate_up_silu_streamk(x, w, plan, ws, counters), full)
    if pdl.supported():
        assert torch.equal(sk.gate_up_silu_streamk(x, w, plan, ws, counters, pdl=True), full)
    for n in (1, 7, 33):
        assert torch.equal(sk.gate_up_silu_streamk(x[:n], w, plan, ws, counters), full[:n]), n


def test_streamk_in_a_cuda_graph_on_fresh_inputs():
    """Captured once (with PDL where supported), replayed on five fresh inputs: each equals an eager launch."""
    from surge.engines.kernels import gate_up_streamk as sk
    from surge.engines.kernels import pdl

    w, g = _weights(4864, 896, 5)
    plan = sk.StreamKPlan()
    ws, counters = sk.workspace(w, plan)
    x = torch.randn(64, 896, generator=g).to("cuda", torch.bfloat16)
    use_pdl = pdl.supported()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sk.gate_up_silu_streamk(x, w, plan, ws, counters, pdl=use_pdl)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = sk.gate_up_silu_streamk(x, w, plan, ws, counters, pdl=use_pdl)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(5):
        x.copy_(torch.randn(64, 896, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, sk.gate_up_silu_streamk(x, w, plan, ws, counters))
        assert int(counters.abs().sum()) == 0


def test_streamk_refuses_what_it_cannot_read():
    from surge.engines.kernels import gate_up_streamk as sk

    plan = sk.StreamKPlan()
    w = torch.randn(2 * 96, 128, device="cuda", dtype=torch.bfloat16)  # I = 96: not a whole number of tiles
    ws, counters = torch.empty(1 << 20, device="cuda"), torch.zeros(8, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="stream-K"):
        sk.gate_up_silu_streamk(torch.randn(4, 128, device="cuda", dtype=torch.bfloat16), w, plan, ws, counters)
    w = torch.randn(2 * 128, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stream-K"):  # more rows than one M tile
        sk.gate_up_silu_streamk(torch.randn(65, 128, device="cuda", dtype=torch.bfloat16), w, plan, ws, counters)
    with pytest.raises(ValueError, match="workspace"):
        sk.gate_up_silu_streamk(torch.randn(4, 128, device="cuda", dtype=torch.bfloat16), w, plan,
                                torch.empty(16, device="cuda"), counters)
