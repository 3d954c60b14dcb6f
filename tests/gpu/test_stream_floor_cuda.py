"""The decode-step floor probe (engines/kernels/stream_floor.py, Gluon, Hopper): every box consumed as dealt, the
barrier counter, and the MMA variant's products against float64, including a phase that reads what the phase
before it wrote on other SMs (the grid barrier and the proxy fence are what make that read see the writes)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper GPU")


def _expected_phase(probe, act, phase):
    """float64: what each program of `phase` writes, given the activations `act` [64, 2W] before it."""
    bounds = probe.bounds.tolist()
    kch = probe.kch.tolist()[phase]
    w, box = probe.act_width, probe.box_rows
    src, dst = (phase % 2) * w, w - (phase % 2) * w
    out = act.clone()
    for p in range(probe.programs):
        acc = torch.zeros(64, box, dtype=torch.float64, device=act.device)
        for j in range(bounds[phase] + p, bounds[phase + 1], probe.programs):
            c = src + ((j - bounds[phase]) % kch) * 64
            acc += act[:, c:c + 64].double() @ probe.weights[j * box:(j + 1) * box].double().T
        if bounds[phase + 1] - bounds[phase] > p:
            col = dst + (p * box) % w
            out[:, col:col + box] = acc.to(act.dtype)
    return out


@pytest.mark.parametrize("box,stages", [(128, 4), (64, 6)])
@pytest.mark.parametrize("sync,mma", [(False, False), (True, False), (True, True)])
def test_every_box_is_consumed_as_dealt_and_the_barrier_counts(box, stages, sync, mma):
    from surge.engines.kernels.stream_floor import StreamFloor

    phases = [("a", 3, 2), ("b", 41, 14), ("c", 0, 1), ("d", 9, 76), ("e", 17, 1)]
    probe = StreamFloor(phases, box_rows=box, stages=stages, programs=8)
    probe.run(sync, mma)
    torch.cuda.synchronize()
    assert torch.equal(probe.counts.cpu(), probe.deal())
    assert probe.deal().sum().item() == 70
    assert int(probe.counter.item()) == (5 * 8 if sync else 0)


def test_products_against_float64_and_a_phase_reads_what_the_last_one_wrote():
    from surge.engines.kernels.stream_floor import StreamFloor

    # phase 2 (K = 4 chunks) reads columns [W, W + 256): what programs 0-1 (box 128) wrote in phase 1
    phases = [("first", 37, 3), ("second", 23, 4), ("third", 11, 2)]
    probe = StreamFloor(phases, box_rows=128, stages=5, programs=6)
    probe.weights.mul_(0.05)
    act0 = probe.act.clone()
    probe.run(sync=True, mma=True)
    torch.cuda.synchronize()
    want = act0
    for ph in range(len(phases)):
        want = _expected_phase(probe, want, ph)
    got = probe.act
    assert not torch.equal(got, act0)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, err
    # the reference can tell: had the second phase read the first one's inputs instead of its outputs, it differs
    w = probe.act_width
    after1 = _expected_phase(probe, act0, 0)
    stale = after1.clone()
    stale[:, w:] = act0[:, w:]
    assert not torch.allclose(_expected_phase(probe, stale, 1)[:, :w].double(),
                              _expected_phase(probe, after1, 1)[:, :w].double(), rtol=1e-2, atol=1e-4)


def test_plans_it_refuses():
    from surge.engines.kernels.stream_floor import StreamFloor

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match="one program an SM"):
        StreamFloor([("a", 4, 1)], programs=sms + 1)
    with pytest.raises(ValueError, match="shared memory"):
        StreamFloor([("a", 4, 1)], box_rows=128, stages=16)
    with pytest.raises(ValueError, match="weights must be BF16"):
        StreamFloor([("a", 4, 1)], box_rows=64, weights=torch.zeros(8, 64, device="cuda", dtype=torch.bfloat16))


def test_step_phases_count_the_steps_bytes():
    from surge.engines.kernels.stream_floor import step_phases

    ph = step_phases(layers=2, hidden=896, inter=4864, heads=14, kv_heads=2, head_dim=64, vocab=151936, batch=64,
                     context=192, box_bytes=16384)
    assert [n for n, _, _ in ph] == ["qkv", "attention", "o", "gate_up", "down"] * 2 + ["lm_head"]
    boxes = dict((n, b) for n, b, _ in ph)
    assert boxes["gate_up"] == -(-2 * 4864 * 896 * 2 // 16384)
    assert boxes["attention"] == -(-64 * 192 * 2 * 2 * 64 * 2 // 16384)
    assert boxes["lm_head"] == -(-151936 * 896 * 2 // 16384)
