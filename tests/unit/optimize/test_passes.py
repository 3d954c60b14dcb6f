"""Each graph pass keeps the model's outputs (random and real inputs) and the node count drops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from surge.optimize.passes import ALL_PASSES, PassContext, graph_passes, run_passes
from tests.unit.optimize.conftest import feeds_for, run_onnx


def _stepwise(model_file, spec, feeds_list, atol, check_every=True):
    """Apply the passes one by one; after each (or only at the end), the outputs must match the source's."""
    model = ir.load(str(model_file))
    expected = [run_onnx(model_file, f) for f in feeds_list]
    ctx = PassContext(num_heads=spec.num_heads, hidden_size=spec.hidden_size)
    reports = []
    names = graph_passes()
    for i, name in enumerate(names):
        reports += run_passes(model, [name], ctx)
        if not check_every and i < len(names) - 1:
            continue
        proto = ir.serde.serialize_model(model).SerializeToString()
        for feeds, exp in zip(feeds_list, expected):
            got = run_onnx(proto, feeds)
            np.testing.assert_allclose(got, exp, atol=atol, rtol=0, err_msg=f"after pass {name}")
    return reports


def test_every_pass_keeps_outputs_tiny_bert(tiny_export, tiny_spec, sentences):
    feeds = [feeds_for(tiny_spec, seed=1), feeds_for(tiny_spec, seed=2, batch=2, seq=7),
             feeds_for(tiny_spec, texts=sentences[:4])]
    reports = _stepwise(tiny_export, tiny_spec, feeds, atol=1e-4)
    assert reports[-1].nodes_after < reports[0].nodes_before
    assert {r.name for r in reports} == set(ALL_PASSES)


def test_bundled_minilm_fully_fused_and_equal(bundled_export, bundled_spec, sentences):
    feeds = [feeds_for(bundled_spec, seed=3, batch=2, seq=24), feeds_for(bundled_spec, texts=sentences[10:18])]
    reports = _stepwise(bundled_export, bundled_spec, feeds, atol=2e-4, check_every=False)
    fused = {r.name: r.changes for r in reports}
    assert fused["attention_fusion"] == bundled_spec.num_layers
    assert fused["skip_layernorm"] == 2 * bundled_spec.num_layers
    assert fused["gelu_fusion"] == bundled_spec.num_layers
    assert fused["embed_layernorm"] == 1
    before, after = reports[0].nodes_before, reports[-1].nodes_after
    assert before >= 5 * after, (before, after)


def test_explain_details_say_what_changed(tiny_export, tiny_spec):
    model = ir.load(str(tiny_export))
    reports = run_passes(model, graph_passes(), PassContext(num_heads=tiny_spec.num_heads, hidden_size=tiny_spec.hidden_size))
    skip = next(r for r in reports if r.name == "skip_layernorm")
    assert skip.op_delta.get("com.microsoft::SkipLayerNormalization", 0) == skip.changes > 0
    assert all(r.details for r in reports)


def test_user_rule_by_import_path_runs(tiny_export, tiny_spec):
    model = ir.load(str(tiny_export))
    ctx = PassContext(num_heads=tiny_spec.num_heads, hidden_size=tiny_spec.hidden_size,
                      user_rules=["tests.unit.optimize.user_rules:erf_to_tanh"])
    (report,) = run_passes(model, ["rewrite_rules"], ctx)
    assert any("ErfToTanh" in d for d in report.details)
    assert report.ops_after.get("Erf", 0) == 0 and report.ops_after.get("Tanh", 0) > 0
