"""The distillation's bank ranking loss (optimize/distill._bank_loss) against its definition in float64."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")


def _reference(s_unit, t_unit, bank, picked, cols, temp):
    total = 0.0
    for r, own in enumerate(picked):
        idx = [c for c in cols if c != own]
        s = [float(s_unit[r].double() @ bank[c].double()) / temp for c in idx]
        t = [float(t_unit[r].double() @ bank[c].double()) / temp for c in idx]
        ms, mt = max(s), max(t)
        ls = ms + math.log(sum(math.exp(x - ms) for x in s))
        lt = mt + math.log(sum(math.exp(x - mt) for x in t))
        total += sum(math.exp(b - lt) * ((b - lt) - (a - ls)) for a, b in zip(s, t))
    return total / len(picked)


def test_bank_loss_is_the_kl_of_the_rankings_without_the_sentence_itself(monkeypatch):
    import torch.nn.functional as F

    from surge.optimize import distill

    g = torch.Generator().manual_seed(7)
    n, h = 300, 24
    bank = F.normalize(torch.randn(n, h, generator=g), dim=-1)
    picked = [3, 150, 299, 42]
    t_unit = bank[picked]
    s_unit = F.normalize(t_unit + 0.3 * torch.randn(len(picked), h, generator=g), dim=-1)
    for size in (n, 64):  # the whole bank, and a draw of 64 columns
        monkeypatch.setattr(distill, "BANK_SIZE", size)
        got = distill._bank_loss(s_unit, t_unit, bank, picked, torch.Generator().manual_seed(1))
        cols = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:size].tolist() if size < n \
            else list(range(n))
        want = _reference(s_unit, t_unit, bank, picked, cols, distill.BANK_TEMPERATURE)
        assert got.item() == pytest.approx(want, rel=1e-4, abs=1e-6)
        assert got.item() > 0
    monkeypatch.setattr(distill, "BANK_SIZE", n)
    same = distill._bank_loss(t_unit, t_unit, bank, picked, torch.Generator().manual_seed(1))
    assert abs(same.item()) < 1e-6
    # the masked entries (the sentences themselves) leave the gradient finite
    loss = distill._bank_loss(s_unit.requires_grad_(), t_unit, bank, picked, torch.Generator().manual_seed(1))
    loss.backward()
    assert torch.isfinite(s_unit.grad).all() and s_unit.grad.abs().sum() > 0


def test_bank_weight_is_validated():
    from surge.errors import ConfigError
    from surge.optimize.distill import DistillOptions

    with pytest.raises(ConfigError, match="bank-weight"):
        DistillOptions(bank_weight=-1).check(6, 1536)
    DistillOptions(bank_weight=0.5).check(6, 1536)
