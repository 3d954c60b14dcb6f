"""FP16/BF16 conversion: the block list holds in the written model, numerics stay close, the search works."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto

from surge.optimize import precision as prec
from surge.optimize.passes import PassContext, graph_passes, run_passes
from surge.optimize.search import search_block_list
from surge.optimize.validate import BUDGETS, Budget, Encoded, compare, run_model, session
from tests.unit.optimize.conftest import feeds_for, run_onnx


@pytest.fixture(scope="module")
def clean_tiny(tiny_export, tiny_spec) -> onnx.ModelProto:
    model = ir.load(str(tiny_export))
    run_passes(model, graph_passes(fuse=False), PassContext(tiny_spec.num_heads, tiny_spec.hidden_size))
    return ir.serde.serialize_model(model)


def _cos(a, b):
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_block_list_respected_in_converted_model(clean_tiny, precision):
    block = ["LayerNormalization", "Softmax"]
    low = prec.convert(clean_tiny, precision, block)
    assert prec.blocked_nodes_ok(low, block) == []
    assert any(n.op_type == "LayerNormalization" for n in low.graph.node)
    dtype = prec.LOW[precision]
    assert sum(t.data_type == dtype for t in low.graph.initializer) >= 4  # the MatMul weights went low
    # ...and the checker would catch a violation: with nothing blocked, LayerNorm runs low.
    assert prec.blocked_nodes_ok(prec.convert(clean_tiny, precision, []), block) != []


def test_fp16_runs_on_cpu_and_matches(clean_tiny, tiny_spec, sentences):
    low = prec.convert(clean_tiny, "fp16", prec.DEFAULT_BLOCK_LIST)
    for feeds in (feeds_for(tiny_spec, seed=5), feeds_for(tiny_spec, texts=sentences[:6])):
        ref = run_onnx(clean_tiny.SerializeToString(), feeds)
        got = run_onnx(low.SerializeToString(), feeds)
        assert np.isfinite(got).all()
        assert _cos(ref, got).min() > 0.999
        # The emulation of the same graph agrees with the real FP16 run.
        emu = run_onnx(prec.emulate(low, "fp16").SerializeToString(), feeds)
        assert _cos(got, emu).min() > 0.9999


def test_bf16_emulation_rounds_to_bf16(clean_tiny, tiny_spec):
    feeds = feeds_for(tiny_spec, seed=6)
    ref = run_onnx(clean_tiny.SerializeToString(), feeds)
    emu = run_onnx(prec.emulate(prec.convert(clean_tiny, "bf16", prec.DEFAULT_BLOCK_LIST), "bf16").SerializeToString(), feeds)
    err = np.abs(emu - ref).max()
    # BF16 has 8 bits of mantissa: visibly less exact than FP16, still the same function.
    assert 1e-4 < err and _cos(ref, emu).min() > 0.99


def test_search_finds_smallest_passing_block_list(clean_tiny, tiny_spec, sentences):
    data = Encoded(tiny_spec, sentences[:24])
    ref = run_model(session(clean_tiny.SerializeToString()), tiny_spec, data)
    tried = []

    def measure(block):
        tried.append(list(block))
        model = prec.emulate(prec.convert(clean_tiny, "bf16", block), "bf16")
        return compare(ref, run_model(session(model.SerializeToString()), tiny_spec, data))

    candidates = prec.float_op_types(clean_tiny)
    assert "LayerNormalization" in candidates and "MatMul" in candidates
    strict = Budget(mean_cosine=1 - 1e-6)  # tighter than bf16 can do unblocked
    all_ops = sorted({n.op_type for n in clean_tiny.graph.node})
    result = search_block_list(candidates, measure, strict, all_op_types=all_ops)
    # Isolated one at a time, the op types differ in how much they cost.
    assert len(set(result.sensitivity.values())) > 1
    assert set(result.sensitivity) == set(candidates)
    passing = [s for s in result.steps if s["passed"]]
    failing = [s for s in result.steps if not s["passed"]]
    assert failing, "an unblocked bf16 model should miss a 1e-6 budget"
    if result.passed:
        assert passing[0]["block_list"] == result.block_list
        assert len(result.block_list) == len(result.steps) - 1  # stopped at the first passing prefix
    loose = search_block_list(candidates, measure, BUDGETS["bf16"], all_op_types=all_ops)
    assert loose.passed and len(loose.block_list) <= len(result.block_list)
