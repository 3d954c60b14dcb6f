"""DecoderModel._cpu_layout: linear weights [in, out] for the CPU's NN GEMMs, same values, same storage."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from surge.engines.decoder.model import DecoderModel


def test_layout_keeps_values_and_storage_and_a_tied_head_keeps_the_embedding():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    embed = torch.randn(50, 16, generator=g, dtype=torch.float64)
    original = {"embed": embed, "lm_head": embed, "l0.qkv": torch.randn(48, 16, generator=g, dtype=torch.float64),
                "l0.qkv.bias": torch.randn(48, generator=g, dtype=torch.float64),
                "l0.attn_norm": torch.randn(16, generator=g, dtype=torch.float64)}
    w = dict(original)
    wt = DecoderModel._cpu_layout(w)
    assert set(wt) == {"l0.qkv", "lm_head"}
    assert torch.equal(w["l0.qkv"], original["l0.qkv"]) and w["l0.qkv"].data_ptr() == wt["l0.qkv"].data_ptr()
    assert w["embed"] is embed and w["lm_head"] is embed  # the embedding keeps its rows; the head has a copy
    assert torch.equal(wt["lm_head"], embed.t())
    assert w["l0.qkv.bias"] is original["l0.qkv.bias"] and w["l0.attn_norm"] is original["l0.attn_norm"]

    model = DecoderModel.__new__(DecoderModel)
    model.w, model._wt, model._scales = w, wt, {}  # no 8-bit weights
    x = torch.randn(5, 16, generator=g, dtype=torch.float64)
    torch.testing.assert_close(model._lin(x, "l0.qkv", w["l0.qkv.bias"]),
                               F.linear(x, original["l0.qkv"], original["l0.qkv.bias"]))
    torch.testing.assert_close(model._lin(x, "lm_head"), x @ embed.t())


def test_laying_out_twice_copies_nothing_more():
    w = {"l0.fc_in": torch.randn(32, 8), "lm_head": torch.randn(20, 8)}
    first = DecoderModel._cpu_layout(w)
    again = DecoderModel._cpu_layout(w)  # e.g. a second engine built on the same weights dict
    assert all(again[k].data_ptr() == first[k].data_ptr() for k in first)
