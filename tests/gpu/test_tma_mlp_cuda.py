"""The TMA-streamed persistent MLP kernel (engines/kernels/tma_mlp.py, Gluon, Hopper): against float64 with the
kernels' rounding points and against session 14's persistent kernel run a phase at a time, the barrier counter, a
row's bits alone and in a batch, a CUDA graph replayed on fresh inputs, the plans it refuses."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.mlp_chain import EPS
from tests.gpu.mlp_chain import reference as _reference
from tests.gpu.mlp_chain import weights as _weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper GPU")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m,h,i,layers,programs", [
    (64, 256, 640, 3, 40),  # 2 groups of 8 rows a program, no extra rows
    (17, 320, 704, 2, 64),  # 1 group a program, 24 programs with 8 more rows; uneven M
    (64, 896, 4864, 2, None),  # Qwen2-0.5B's MLP on every SM: 32 rows a program, 40 for the first I/8 % SMs
])
def test_against_float64_and_the_persistent_kernel(m, h, i, layers, programs):
    from surge.engines.kernels.persistent_mlp import persistent_mlp
    from surge.engines.kernels.tma_mlp import barriers, tma_mlp

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = programs or sms
    norms, wgu, wd = _weights(layers, h, i, seed=m + h)
    resid = torch.randn(m, h, device="cuda").to(torch.bfloat16)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    r1 = resid.clone()
    h1 = tma_mlp(r1, norms, wgu, wd, EPS, counter, programs=programs)
    torch.cuda.synchronize()
    assert int(counter.item()) == barriers(layers) * programs
    r_ref, h_ref = _reference(resid, norms, wgu, wd)
    r2 = resid.clone()
    h2 = persistent_mlp(r2, norms, wgu, wd, EPS, programs=64, counter=counter, sync=False, splits=2, block_kd=128)
    # the same rounding points; only FP32 summation orders differ (MMA shapes, split-K ranges)
    assert _rel(h1, h_ref) < max(2 * _rel(h2, h_ref), 2e-3), (_rel(h1, h_ref), _rel(h2, h_ref))
    assert _rel(r1, r_ref) < max(2 * _rel(r2, r_ref), 1e-3)
    assert not torch.equal(r1, resid)  # the residual was updated in place


def test_a_rows_bits_do_not_depend_on_its_batch_and_runs_repeat():
    from surge.engines.kernels.tma_mlp import tma_mlp

    norms, wgu, wd = _weights(2, 256, 512, seed=3)
    resid = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    full = tma_mlp(resid.clone(), norms, wgu, wd, EPS, counter, programs=32)
    counter.zero_()
    again = tma_mlp(resid.clone(), norms, wgu, wd, EPS, counter, programs=32)
    counter.zero_()
    alone = tma_mlp(resid[5:6].clone(), norms, wgu, wd, EPS, counter, programs=32)
    assert torch.equal(full, again)
    assert torch.equal(full[5:6], alone)


def test_a_cuda_graph_replays_on_fresh_inputs():
    from surge.engines.kernels.tma_mlp import tma_mlp

    norms, wgu, wd = _weights(2, 256, 640, seed=5)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    static_r = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        counter.zero_()
        tma_mlp(static_r.clone(), norms, wgu, wd, EPS, counter, programs=40)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            counter.zero_()
            out = tma_mlp(static_r, norms, wgu, wd, EPS, counter, programs=40)
    torch.cuda.synchronize()
    for seed in range(3):
        fresh = torch.randn(64, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        fresh = fresh.to(torch.bfloat16)
        static_r.copy_(fresh)
        g.replay()
        torch.cuda.synchronize()
        counter.zero_()
        direct = tma_mlp(fresh.clone(), norms, wgu, wd, EPS, counter, programs=40)
        assert torch.equal(out, direct)


def test_plans_it_refuses():
    from surge.engines.kernels.tma_mlp import plan, tma_mlp

    norms, wgu, wd = _weights(1, 256, 640, seed=7)
    resid = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match="resident"):
        tma_mlp(resid, norms, wgu, wd, EPS, counter, programs=sms + 1)
    with pytest.raises(ValueError, match="power of two"):
        plan(256, 640, 26)  # 80 groups of 8 rows over 26 programs: 3 a program (a 24-row TMA box)
    norms2, wgu2, wd2 = _weights(1, 200, 640, seed=8)
    with pytest.raises(ValueError, match="multiples of 64"):
        tma_mlp(torch.randn(8, 200, device="cuda").to(torch.bfloat16), norms2, wgu2, wd2, EPS, counter, programs=40)


@pytest.mark.parametrize("pdl", [False, True])
def test_a_launch_a_layer_equals_one_launch(pdl):
    from surge.engines.kernels.tma_mlp import barriers, tma_mlp

    norms, wgu, wd = _weights(3, 256, 640, seed=11)
    resid = torch.randn(33, 256, device="cuda").to(torch.bfloat16)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    r1 = resid.clone()
    h1 = tma_mlp(r1, norms, wgu, wd, EPS, counter, programs=40)
    counter.zero_()
    r2, h2 = resid.clone(), torch.empty_like(resid)
    arrivals = 0
    for layer in range(3):
        tma_mlp(r2, norms, wgu, wd, EPS, counter, programs=40, layers=(layer, layer + 1), arrivals=arrivals, out=h2,
                pdl=pdl)
        arrivals += barriers(layer + 1, layer) * 40
    torch.cuda.synchronize()
    assert int(counter.item()) == arrivals
    assert torch.equal(h1, h2) and torch.equal(r1, r2)
