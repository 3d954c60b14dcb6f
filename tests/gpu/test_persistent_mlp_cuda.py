"""The persistent MLP kernel (engines/kernels/persistent_mlp.py): one synchronized launch against the same code a
phase at a time (bit for bit: a barrier that let a program run ahead reads stale activations), the barrier
counter, float64 with the kernels' rounding points, a row's bits alone and in a batch, the residency check."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.mlp_chain import EPS
from tests.gpu.mlp_chain import reference as _reference
from tests.gpu.mlp_chain import weights as _weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("m,h,i,layers,plan", [
    (64, 256, 640, 3, dict(block_g=32, block_k=128, block_d=32, block_kd=128, splits=3)),
    (17, 320, 704, 2, dict(block_g=64, block_k=64, block_d=64, block_kd=256, splits=2)),  # uneven K, H, I
    (64, 256, 640, 3, dict(block_g=32, block_k=128, block_d=32, block_kd=128, splits=3, preload=True)),
    (17, 320, 704, 2, dict(block_g=64, block_k=64, block_d=64, block_kd=256, splits=2, preload=True)),
])
def test_synchronized_equals_phase_by_phase_and_reference(m, h, i, layers, plan):
    from surge.engines.kernels.persistent_mlp import barriers, persistent_mlp

    norms, wgu, wd = _weights(layers, h, i, seed=m)
    resid = torch.randn(m, h, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    r1, r2 = resid.clone(), resid.clone()
    h1 = persistent_mlp(r1, norms, wgu, wd, EPS, programs=sms, counter=counter, sync=True, **plan)
    torch.cuda.synchronize()
    assert int(counter.item()) == barriers(layers) * sms
    steps = {k: v for k, v in plan.items() if k != "preload"}  # where a block is loaded changes no bit
    h2 = persistent_mlp(r2, norms, wgu, wd, EPS, programs=sms, counter=counter, sync=False, **steps)
    assert torch.equal(h1, h2) and torch.equal(r1, r2)
    r_ref, h_ref = _reference(resid, norms, wgu, wd)
    rel = ((h1.double() - h_ref.double()).norm() / h_ref.double().norm()).item()
    assert rel < 2e-2, rel  # BF16 rounding points shared; only FP32 summation orders differ
    assert not torch.equal(r1, resid)  # the residual was updated in place


def test_a_rows_bits_do_not_depend_on_its_batch():
    from surge.engines.kernels.persistent_mlp import persistent_mlp

    norms, wgu, wd = _weights(2, 256, 512, seed=3)
    resid = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    full = persistent_mlp(resid.clone(), norms, wgu, wd, EPS, programs=64, counter=counter, splits=2, block_kd=128)
    counter.zero_()
    alone = persistent_mlp(resid[5:6].clone(), norms, wgu, wd, EPS, programs=64, counter=counter, splits=2,
                           block_kd=128)
    assert torch.equal(full[5:6], alone)


def test_in_a_cuda_graph_with_the_counter_zeroed_inside():
    from surge.engines.kernels.persistent_mlp import persistent_mlp

    norms, wgu, wd = _weights(2, 256, 512, seed=4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    resid = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    static = resid.clone()
    kw = dict(programs=sms, counter=counter, splits=2, block_kd=128)
    persistent_mlp(static.clone(), norms, wgu, wd, EPS, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        counter.zero_()
        out = persistent_mlp(static, norms, wgu, wd, EPS, **kw)
    for _ in range(3):
        fresh = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
        static.copy_(fresh)
        g.replay()
        counter2 = torch.zeros(1, device="cuda", dtype=torch.int32)
        want = persistent_mlp(fresh.clone(), norms, wgu, wd, EPS, programs=sms, counter=counter2, splits=2,
                              block_kd=128)
        assert torch.equal(out, want)


def test_more_programs_than_can_be_resident_is_refused():
    from surge.engines.kernels.persistent_mlp import persistent_mlp

    norms, wgu, wd = _weights(1, 256, 512, seed=5)
    resid = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match="resident"):
        persistent_mlp(resid, norms, wgu, wd, EPS, programs=sms * 64, counter=counter, splits=2, block_kd=128)


@pytest.mark.parametrize("m,h,i,layers,plan", [
    (64, 256, 640, 3, dict(block_g=32, block_k=128, block_d=32, block_kd=128, splits=3)),
    (17, 320, 704, 2, dict(block_g=64, block_k=64, block_d=64, block_kd=256, splits=2)),  # uneven K, H, I
])
def test_dataflow_kernel_against_reference_barrier_kernel_and_itself(m, h, i, layers, plan):
    import triton

    from surge.engines.kernels.dataflow_mlp import counters, dataflow_mlp
    from surge.engines.kernels.persistent_mlp import persistent_mlp

    norms, wgu, wd = _weights(layers, h, i, seed=10 + m)
    resid = torch.randn(m, h, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = counters(layers, h, i, plan["splits"], plan["block_d"], plan["block_kd"])
    outs = []
    for _ in range(2):
        cnt = torch.zeros(n, device="cuda", dtype=torch.int32)
        r = resid.clone()
        outs.append((dataflow_mlp(r, norms, wgu, wd, EPS, programs=sms, counter=cnt, **plan), r, cnt))
    (h1, r1, cnt), (h2, r2, _) = outs
    assert torch.equal(h1, h2) and torch.equal(r1, r2)  # deterministic whatever the programs' timing
    k_split = triton.cdiv(triton.cdiv(i, plan["splits"]), plan["block_kd"]) * plan["block_kd"]
    splits, ncol = triton.cdiv(i, k_split), triton.cdiv(h, plan["block_d"])
    per_split = [triton.cdiv(min(k_split, i - s * k_split), plan["block_g"]) for s in range(splits)]
    want = [ncol] * (layers + 1) + per_split * layers + [splits] * (ncol * layers)
    assert cnt.tolist() == want
    r_ref, h_ref = _reference(resid, norms, wgu, wd)
    rel = ((h1.double() - h_ref.double()).norm() / h_ref.double().norm()).item()
    assert rel < 2e-2, rel
    hb = persistent_mlp(resid.clone(), norms, wgu, wd, EPS, programs=sms,
                        counter=torch.zeros(1, device="cuda", dtype=torch.int32), **plan)
    # the same rounding points; only the mean square's summation order differs from the barrier kernel
    assert ((h1.double() - hb.double()).norm() / hb.double().norm()).item() < 1e-2


def test_dataflow_rows_do_not_depend_on_the_batch():
    from surge.engines.kernels.dataflow_mlp import counters, dataflow_mlp

    norms, wgu, wd = _weights(2, 256, 512, seed=21)
    resid = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    plan = dict(splits=2, block_kd=128)
    n = counters(2, 256, 512, 2, 32, 128)
    full = dataflow_mlp(resid.clone(), norms, wgu, wd, EPS, programs=64,
                        counter=torch.zeros(n, device="cuda", dtype=torch.int32), **plan)
    alone = dataflow_mlp(resid[9:10].clone(), norms, wgu, wd, EPS, programs=64,
                         counter=torch.zeros(n, device="cuda", dtype=torch.int32), **plan)
    assert torch.equal(full[9:10], alone)
