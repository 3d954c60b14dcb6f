"""Every rewrite rule in surge's library fires on the graph it is for and keeps the numbers."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.rewriter import RewriteRuleSet

from surge.optimize.rules import arith, default_rules, load_user_rules, split_concat


def _model(nodes, x_shape, out_shape=None, inits=()):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _apply(proto, rules):
    model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))
    count = RewriteRuleSet(rules).apply_to_model(model)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return count, ir.serde.serialize_model(model)


def _check(proto, rules, x, rtol=1e-6, atol=1e-6):
    expected = _run(proto, x)
    count, rewritten = _apply(proto, rules)
    assert count >= 1, "rule did not fire"
    got = _run(rewritten, x)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    return rewritten


def _ops(proto):
    return [n.op_type for n in proto.graph.node]


@pytest.mark.parametrize("n,axis", [(2, 1), (3, -1), (4, 0)])
def test_split_concat_identity(n, axis):
    x = np.random.default_rng(n).standard_normal((8, 12, 12)).astype(np.float32)
    outs = [f"s{i}" for i in range(n)]
    nodes = [helper.make_node("Split", ["x"], outs, axis=axis, num_outputs=n),
             helper.make_node("Concat", outs, ["y"], axis=axis)]
    rewritten = _check(_model(nodes, list(x.shape)), split_concat.rules(), x)
    assert "Split" not in _ops(rewritten) and "Concat" not in _ops(rewritten)


def test_split_concat_in_other_order_is_not_identity():
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    nodes = [helper.make_node("Split", ["x"], ["a", "b"], axis=1, num_outputs=2),
             helper.make_node("Concat", ["b", "a"], ["y"], axis=1)]
    count, _ = _apply(_model(nodes, [4, 6]), [split_concat.SplitConcatIdentity.rule(2)])
    assert count == 0


@pytest.mark.parametrize("n,axis", [(2, 1), (3, 2), (4, 1)])
def test_split_concat_interleave_becomes_reshape_expand(n, axis):
    shape = [2, 12, 12]
    x = np.random.default_rng(n).standard_normal(shape).astype(np.float32)
    outs = [f"s{i}" for i in range(n)]
    doubled = [o for o in outs for _ in range(2)]
    nodes = [helper.make_node("Split", ["x"], outs, axis=axis, num_outputs=n),
             helper.make_node("Concat", doubled, ["y"], axis=axis)]
    rewritten = _check(_model(nodes, shape), split_concat.rules(), x)
    ops = _ops(rewritten)
    assert "Split" not in ops and "Concat" not in ops and "Expand" in ops and "Reshape" in ops


@pytest.mark.parametrize("r", [2, 3, 4])
def test_concat_repeat_becomes_tile(r):
    x = np.random.default_rng(r).standard_normal((3, 5)).astype(np.float32)
    nodes = [helper.make_node("Concat", ["x"] * r, ["y"], axis=0)]
    rewritten = _check(_model(nodes, [3, 5]), split_concat.rules(), x)
    assert _ops(rewritten) == ["Tile"] or "Concat" not in _ops(rewritten)


def test_div_by_constant_becomes_mul():
    x = np.random.default_rng(1).standard_normal((4, 7)).astype(np.float32)
    c = numpy_helper.from_array(np.array(5.656854, np.float32), "c")
    nodes = [helper.make_node("Div", ["x", "c"], ["y"])]
    rewritten = _check(_model(nodes, [4, 7], inits=[c]), arith.rules(), x, rtol=1e-6)
    assert "Div" not in _ops(rewritten)


def test_div_by_zero_is_left_alone():
    c = numpy_helper.from_array(np.array(0.0, np.float32), "c")
    count, _ = _apply(_model([helper.make_node("Div", ["x", "c"], ["y"])], [2, 2], inits=[c]), arith.rules())
    assert count == 0


@pytest.mark.parametrize("op", ["Mul", "Add"])
def test_chained_scalar_constants_merge(op):
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    a = numpy_helper.from_array(np.array(1.7, np.float32), "a")
    b = numpy_helper.from_array(np.array([-0.3], np.float32), "b")
    nodes = [helper.make_node(op, ["x", "a"], ["t"]), helper.make_node(op, ["t", "b"], ["y"])]
    rewritten = _check(_model(nodes, [3, 4], inits=[a, b]), arith.rules(), x, rtol=1e-6, atol=1e-6)
    assert _ops(rewritten).count(op) == 1


def test_library_rules_all_named_and_loadable_by_import_path():
    names = [r.name for r in default_rules()]
    assert len(names) == len(set(names)) and all(names)
    assert [r.name for r in load_user_rules("surge.optimize.rules.arith:rules")] == [r.name for r in arith.rules()]


def test_bad_user_rule_path_is_a_clear_error():
    from surge.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot import"):
        load_user_rules("surge.nope:rule")
    with pytest.raises(ConfigError, match="not a rewrite rule"):
        load_user_rules("surge.optimize.rules.arith:np")
