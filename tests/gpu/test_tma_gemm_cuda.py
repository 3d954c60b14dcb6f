"""The layer GEMMs with their operands read by TMA (kernels/tma.py; `tma=True` plans of kernels/splitk_gemm.py
and kernels/gate_up.py) on a CUDA GPU: the same bits as the pointer-load kernels with the same tiles, for
every row count, uneven K and N (the copy engine's zero fill standing in for the masks), with PDL, inside a
CUDA graph replayed on fresh inputs; and the tensors TMA cannot read fall back to pointer loads."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

# Before Hopper no tensor takes the TMA path, and TMA == pointer loads would hold by running pointer loads twice.
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="needs a Hopper GPU")]

ROWS = (1, 7, 33, 64, 69)  # 69: two M tiles, the second with 5 rows


def _pdl_modes():
    from surge.engines.kernels import pdl

    return (False, True) if pdl.supported() else (False,)


def _splitk_plans(n, k):
    from surge.engines.kernels.splitk_gemm import SplitKPlan, plan_for

    plans = [SplitKPlan(32, 128, 4, num_stages=3, tma=True), SplitKPlan(64, 64, 5, num_stages=4, swap=True, tma=True),
             SplitKPlan(128, 256, 2, num_stages=2, tma=True)]
    measured = plan_for(n, k)
    return plans + ([measured] if measured is not None and measured.tma else [])


@pytest.mark.parametrize("n,k", [(896, 4864), (896, 896), (1152, 896), (3072, 2048), (2048, 2048), (2048, 8192),
                                 (200, 1000)])
def test_tma_partials_equal_pointer_partials_bit_for_bit(n, k):
    from surge.engines.kernels import tma
    from surge.engines.kernels.splitk_gemm import partials

    gen = torch.Generator(device="cuda").manual_seed(n + 3 * k)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    for plan in _splitk_plans(n, k):
        pointer = dataclasses.replace(plan, tma=False)
        for m in ROWS:
            a = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            assert tma.usable(a, w)  # the TMA kernel is what runs, not the fallback
            want = partials(a, w, pointer)
            for pdl in _pdl_modes():
                out = torch.full_like(want, float("nan"))  # every partial must be written
                got = partials(a, w, plan, out=out, pdl=pdl)
                assert torch.equal(got, want), (plan, m, pdl, (got - want).abs().max().item())


@pytest.mark.parametrize("i,k", [(4864, 896), (8192, 2048), (512, 200)])
def test_tma_gate_up_equals_pointer_gate_up_bit_for_bit(i, k):
    from surge.engines.kernels import tma
    from surge.engines.kernels.gate_up import GateUpPlan, gate_up_silu, plan_for

    gen = torch.Generator(device="cuda").manual_seed(i + k)
    w = (torch.randn(2 * i, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
    plans = [GateUpPlan(64, 128, 4, 4, tma=True), GateUpPlan(32, 64, 4, 3, swap=True, tma=True)]
    if plan_for(i, k) is not None and plan_for(i, k).tma:
        plans.append(plan_for(i, k))
    for plan in plans:
        pointer = dataclasses.replace(plan, tma=False)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            assert tma.usable(x, w) and i % plan.block_n == 0  # the TMA kernel is what runs
            want = gate_up_silu(x, w, pointer)
            for pdl in _pdl_modes():
                got = gate_up_silu(x, w, plan, pdl=pdl)
                assert torch.equal(got, want), (plan, m, pdl)


def test_tma_chain_in_a_cuda_graph_replays_on_fresh_inputs():
    """gate/up -> down partials (TMA, PDL where supported) captured once: each replay on new inputs copied
    into the captured buffers equals the eager pointer-load chain (the descriptors made while capturing
    point at the graph's own tensors)."""
    from surge.engines.kernels.gate_up import GateUpPlan, gate_up_silu
    from surge.engines.kernels.splitk_gemm import SplitKPlan, partials

    gen = torch.Generator(device="cuda").manual_seed(11)
    i, k = 4864, 896
    w_gu = (torch.randn(2 * i, k, generator=gen, device="cuda") / 30).to(torch.bfloat16)
    w_dn = (torch.randn(k, i, generator=gen, device="cuda") / 70).to(torch.bfloat16)
    gu, dn = GateUpPlan(64, 128, 4, 4, tma=True), SplitKPlan(32, 256, 4, num_stages=4, tma=True)
    pdl = _pdl_modes()[-1]
    x = torch.randn(64, k, generator=gen, device="cuda").to(torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        partials(gate_up_silu(x, w_gu, gu, pdl=pdl), w_dn, dn, pdl=pdl)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = partials(gate_up_silu(x, w_gu, gu, pdl=pdl), w_dn, dn, pdl=pdl)
    for _ in range(5):
        x.copy_(torch.randn(64, k, generator=gen, device="cuda").to(torch.bfloat16))
        graph.replay()
        want = partials(gate_up_silu(x, w_gu, dataclasses.replace(gu, tma=False)), w_dn,
                        dataclasses.replace(dn, tma=False))
        assert torch.equal(out, want)


def test_tensors_tma_cannot_read_fall_back_to_pointer_loads():
    from surge.engines.kernels import tma
    from surge.engines.kernels.splitk_gemm import SplitKPlan, partials

    gen = torch.Generator(device="cuda").manual_seed(5)
    big = torch.randn(16, 900, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(96, 896, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
    misaligned = big[:, 1:897]  # base 2 bytes past an aligned address
    assert not tma.usable(misaligned, w)
    assert not tma.usable(big.T, w)  # last dimension not contiguous
    assert not tma.usable(big.cpu(), w)
    assert tma.usable(big[:, :896].contiguous(), w)
    plan = SplitKPlan(32, 128, 4, num_stages=3, tma=True)
    got = partials(misaligned, w, plan)
    want = partials(misaligned.contiguous(), w, dataclasses.replace(plan, tma=False))
    assert torch.equal(got, want)
