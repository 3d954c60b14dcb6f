"""Workspace planning, the memory report and `surge inspect memory` (CPU-runnable parts)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from surge.cli.main import app
from surge.engines.encoder_weights import read_config
from surge.engines.memory import (Workspace, memory_report, naive_activation_bytes, plan_workspace,
                                  resident_layers)
from surge.errors import EngineError


@pytest.fixture(scope="module")
def cfg(bundled_spec):
    return read_config(bundled_spec.path)


def test_plan_regions_are_disjoint_aligned_and_cover_a_layer(cfg):
    plan = plan_workspace(cfg, 1000, 8, torch.float16)
    spans = sorted((r.offset, r.offset + r.nbytes) for r in plan.regions)
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1
    assert all(r.offset % 256 == 0 for r in plan.regions)
    h, f = cfg.hidden, cfg.intermediate
    assert plan.region("big").shape == (1000 * max(3 * h, f),)  # qkv, then ffn, in the same bytes
    big = plan_workspace(cfg, 40000, 8, torch.float16)  # chunked FFN: qkv is the largest tenant
    assert big.region("big").shape == (40000 * 3 * h,) and big.region("tmp").shape == (8192, h)
    assert plan.nbytes < naive_activation_bytes(cfg, 8, 125, 2) / 10


def test_workspace_views_and_growth():
    from surge.engines.encoder_weights import EncoderConfig

    c = EncoderConfig("bert", 64, 4, 2, 128, 100, 64, 2, 1e-12, "gelu", 0)
    plan = plan_workspace(c, 64, 4, torch.float32)
    ws = Workspace("cpu", plan.nbytes)
    v = ws.views(plan, 10, 2, 64, 128)
    assert v["x"].shape == (10, 64) and v["qkv"].shape == (10, 192) and v["ffn"].shape == (10, 128) and v["inputs"].shape == (3 * 10 + 3,) and v["inputs"].dtype == torch.int32
    v["x"].fill_(1.0)
    v["tmp"].fill_(2.0)
    assert float(v["x"].sum()) == 640.0  # regions do not overlap
    gen = ws.generation
    assert not ws.grow(plan.nbytes) and ws.generation == gen
    assert ws.grow(plan.nbytes * 2) and ws.generation == gen + 1 and ws.nbytes == plan.nbytes * 2


def test_resident_layers_under_a_budget():
    assert resident_layers(10, 12, 50, 10_000) == 12
    assert resident_layers(10, 12, 50, 50 + 20 + 35) == 3
    with pytest.raises(EngineError, match="budget"):
        resident_layers(10, 12, 50, 60)


def test_report_peak_is_the_sum_of_its_parts(cfg):
    rep = memory_report(cfg, 64, 512, torch.float16)
    assert rep["peak"] == rep["context"] + rep["weights"] + rep["workspace"] + rep["libraries"]
    assert rep["naive_peak"] > 5 * rep["peak"]
    sub = memory_report(cfg, 64, 512, torch.float16, weight_budget=rep["weights"] * 3 // 4)
    assert sub["weights"] <= rep["weights"] * 3 // 4 and sub["weights_total"] == rep["weights"]


def test_inspect_memory_cli():
    res = CliRunner().invoke(app, ["inspect", "memory", "bundled", "--batch", "4", "--seq", "128"])
    assert res.exit_code == 0, res.output
    assert "peak" in res.output and "naive sum" in res.output and "workspace" in res.output
    bad = CliRunner().invoke(app, ["inspect", "memory", "/nonexistent/model"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
