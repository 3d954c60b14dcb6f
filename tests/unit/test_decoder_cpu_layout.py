"""engines/decoder/cpu_layout.py: the CPU's linear weights kept [in, out] or [out, in] (same values; the [in, out]
form shares the dict's storage), and `choose` keeping whichever layout its timings say is faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surge.engines.decoder import cpu_layout
from surge.engines.decoder.model import DecoderModel

LINEAR = DecoderModel.LINEAR


def _weights(g):
    embed = torch.randn(50, 16, generator=g, dtype=torch.float64)
    return {"embed": embed, "lm_head": embed, "l0.qkv": torch.randn(48, 16, generator=g, dtype=torch.float64),
            "l0.qkv.bias": torch.randn(48, generator=g, dtype=torch.float64),
            "l0.attn_norm": torch.randn(16, generator=g, dtype=torch.float64)}


def _model(w, wt):
    model = DecoderModel.__new__(DecoderModel)
    model.w, model._wt, model._scales, model._w8a8 = w, wt, {}, {}  # no 8-bit weights, no W8A8
    return model


def test_in_out_keeps_values_and_storage_and_a_tied_head_keeps_the_embedding():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    original = _weights(g)
    embed = original["embed"]
    w = dict(original)
    wt = cpu_layout.lay_out(w, LINEAR)
    assert set(wt) == {"l0.qkv", "lm_head"}
    assert torch.equal(w["l0.qkv"], original["l0.qkv"]) and w["l0.qkv"].data_ptr() == wt["l0.qkv"].data_ptr()
    assert w["embed"] is embed and w["lm_head"] is embed  # the embedding keeps its rows; the head has a copy
    assert torch.equal(wt["lm_head"], embed.t())
    assert w["l0.qkv.bias"] is original["l0.qkv.bias"] and w["l0.attn_norm"] is original["l0.attn_norm"]

    model = _model(w, wt)
    x = torch.randn(5, 16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(model._lin(x, "l0.qkv", w["l0.qkv.bias"]),
                               F.linear(x, original["l0.qkv"], original["l0.qkv.bias"]))
    torch.testing.assert_close(model._lin(x, "lm_head"), x @ embed.t())


@pytest.mark.parametrize("layers,head", [("out_in", "out_in"), ("out_in", "in_out"), ("in_out", "out_in")])
def test_each_layout_gives_the_same_products(layers, head):
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    original = _weights(g)
    w = dict(original)
    cpu_layout.lay_out(w, LINEAR)  # as a second engine on the same dict finds it: [in, out] views
    wt = cpu_layout.lay_out(w, LINEAR, layers=layers, lm_head=head)
    assert ("l0.qkv" in wt) == (layers == "in_out") and ("lm_head" in wt) == (head == "in_out")
    if layers == "out_in":  # F.linear's own layout again, not a view of the [in, out] copy
        assert w["l0.qkv"].is_contiguous() and torch.equal(w["l0.qkv"], original["l0.qkv"])
    if head == "out_in":
        assert w["lm_head"] is original["embed"]  # tied: the embedding itself, no copy
    model = _model(w, wt)
    x = torch.randn(7, 16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(model._lin(x, "l0.qkv", w["l0.qkv.bias"]),
                               F.linear(x, original["l0.qkv"], original["l0.qkv.bias"]))
    torch.testing.assert_close(model._lin(x, "lm_head"), x @ original["embed"].t())


def test_laying_out_twice_copies_nothing_more():
    w = {"l0.fc_in": torch.randn(32, 8), "lm_head": torch.randn(20, 8)}
    first = cpu_layout.lay_out(w, LINEAR)
    again = cpu_layout.lay_out(w, LINEAR)  # e.g. a second engine built on the same weights dict
    assert all(again[k].data_ptr() == first[k].data_ptr() for k in first)


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="in_out or out_in"):
        cpu_layout.lay_out({}, LINEAR, layers="auto")


@pytest.mark.parametrize("linear_cost,matmul_cost,want", [(1.0, 3.0, "out_in"), (3.0, 1.0, "in_out")])
def test_choose_keeps_the_layout_its_timer_says_is_faster(monkeypatch, linear_cost, matmul_cost, want):
    """A virtual clock that F.linear ([out, in]) and torch.matmul ([in, out]) advance by set costs: the
    choice follows the costs, never the machine, and each call multiplies the weights it was given."""
    clock, calls = [0.0], []
    real_linear, real_matmul = F.linear, torch.matmul

    def linear(x, w, *a):
        clock[0] += linear_cost
        calls.append(("out_in", tuple(w.shape), x.shape[0]))
        return real_linear(x, w, *a)

    def matmul(x, w):
        clock[0] += matmul_cost
        calls.append(("in_out", tuple(w.shape), x.shape[0]))
        return real_matmul(x, w)

    monkeypatch.setattr(cpu_layout.F, "linear", linear)
    monkeypatch.setattr(cpu_layout.torch, "matmul", matmul)
    g = torch.Generator().manual_seed(3)
    w = {f"l{i}.{m}": torch.randn(24, 8, generator=g) for i in range(6) for m in ("qkv", "down")}
    w["lm_head"] = torch.randn(40, 8, generator=g)
    w["l0.qkv.bias"] = torch.randn(24, generator=g)
    chosen = cpu_layout.choose(w, LINEAR, rows=100, repeats=3, timer=lambda: clock[0], min_bytes=0)
    assert chosen == {"layers": want, "lm_head": want}
    # the first SAMPLE_LAYERS layers' two weights and the head, each layout once untimed + 3 times, rows capped
    assert {r for _, _, r in calls} == {cpu_layout.MAX_ROWS}
    assert sum(1 for k, s, _ in calls if k == "out_in" and s == (24, 8)) == 2 * cpu_layout.SAMPLE_LAYERS * 4
    assert sum(1 for k, s, _ in calls if k == "in_out" and s == (8, 24)) == 2 * cpu_layout.SAMPLE_LAYERS * 4
    assert sum(1 for k, s, _ in calls if s in ((40, 8), (8, 40))) == 2 * 4
    assert cpu_layout.choose({"embed": w["lm_head"]}, LINEAR, rows=4, min_bytes=0) == \
        {"layers": "in_out", "lm_head": "in_out"}
    # a big model's layers: sampling stops at the layer that brings the sample to SAMPLE_BYTES (here the second)
    calls.clear()
    monkeypatch.setattr(cpu_layout, "SAMPLE_BYTES", w["l0.qkv"].nbytes + w["l0.down"].nbytes + 1)
    cpu_layout.choose(w, LINEAR, rows=4, timer=lambda: clock[0], min_bytes=0)
    assert sum(1 for k, s, _ in calls if k == "out_in" and s == (24, 8)) == 2 * 2 * 4
    # weights the caches hold are not timed (their timings would pick at random): in_out, no call made
    calls.clear()
    small = sum(t.nbytes for n, t in w.items() if n.startswith(("l0.", "l1.", "l2.", "l3.")) and t.dim() == 2)
    assert cpu_layout.choose(w, LINEAR, rows=4, timer=lambda: clock[0], min_bytes=small + 1) == \
        {"layers": "in_out", "lm_head": "in_out"}
    assert not calls
