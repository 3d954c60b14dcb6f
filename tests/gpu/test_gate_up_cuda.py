"""SiLU(gate) * up in one kernel (kernels/gate_up.py) on a CUDA GPU: against float64 on fresh random inputs,
against cuBLAS + silu_mul, bit-identical with and without PDL, and a row's bits independent of its batch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


def _ref(x, w):
    i = w.shape[0] // 2
    g = (x.double() @ w[:i].double().T).to(x.dtype).double()
    u = (x.double() @ w[i:].double().T).to(x.dtype).double()
    return g * torch.sigmoid(g) * u


def _plans(i, k):
    from surge.engines.kernels.gate_up import GateUpPlan, default_plan, plan_for

    out = [default_plan(i, k), GateUpPlan(16, 64, 4, 2, True), GateUpPlan(64, 128, 8, 3, False),
           GateUpPlan(32, 256, 4, 4, True)]
    if plan_for(i, k) is not None:
        out.append(plan_for(i, k))
    return out


@pytest.mark.parametrize("i,k", [(4864, 896), (8192, 2048), (512, 256), (200, 200)])
def test_gate_up_silu_against_float64_and_cublas(i, k):
    """Every plan (swapped and not, K a multiple of BLOCK_K or not), M of 1 to 69 rows (two M tiles):
    within BF16 rounding of the float64 reference, as close as cuBLAS + silu_mul is; NaN never."""
    import torch.nn.functional as F

    from surge.engines.kernels.decoder_fused import silu_mul
    from surge.engines.kernels.gate_up import gate_up_silu

    g = torch.Generator().manual_seed(i + k)
    w = (torch.randn(2 * i, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
    for m in (1, 7, 33, 64, 69):
        x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
        ref = _ref(x, w)
        pair = silu_mul(F.linear(x, w), torch.bfloat16)
        pair_err = ((pair.double() - ref).norm() / ref.norm()).item()
        for plan in _plans(i, k):
            out = gate_up_silu(x, w, plan)
            assert out.shape == (m, i) and not out.isnan().any()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < max(2 * pair_err, 2e-3), (m, plan, err, pair_err)


def test_gate_up_silu_pdl_and_batch_invariance():
    """With PDL the same bits as without; a row alone gives the bits it gives in batches of 7, 33, 64."""
    from surge.engines.kernels import pdl
    from surge.engines.kernels.gate_up import gate_up_silu

    g = torch.Generator().manual_seed(3)
    i, k = 4864, 896
    w = (torch.randn(2 * i, k, generator=g) / 30).to("cuda", torch.bfloat16)
    x = torch.randn(64, k, generator=g).to("cuda", torch.bfloat16)
    for plan in _plans(i, k):
        full = gate_up_silu(x, w, plan)
        if pdl.supported():
            assert torch.equal(gate_up_silu(x, w, plan, pdl=True), full), plan
        for n in (1, 7, 33):
            assert torch.equal(gate_up_silu(x[:n], w, plan), full[:n]), (plan, n)


def test_gate_up_silu_rejects_bad_weights():
    from surge.engines.kernels.gate_up import default_plan, gate_up_silu

    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2I"):
        gate_up_silu(x, torch.randn(129, 64, device="cuda", dtype=torch.bfloat16), default_plan(64, 64))
    with pytest.raises(ValueError, match="contiguous"):
        gate_up_silu(x, torch.randn(64, 128, device="cuda", dtype=torch.bfloat16).T, default_plan(64, 64))
