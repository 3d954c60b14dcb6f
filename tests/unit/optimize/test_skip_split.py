"""SkipLayerNormalization split back into Add + LayerNormalization: same numbers, measured choice."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx import numpy_helper as nh

from surge.optimize.skip_split import DISABLED_OPTIMIZERS, choose, split_skip_layernorm

H = 48


def _graph(rng) -> onnx.ModelProto:
    """Two chained SkipLayerNormalizations, the first with a bias and its sum output feeding the second."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, H])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 5, H])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, H])
    inits = [nh.from_array(rng.standard_normal(H).astype(np.float32), n) for n in ("g1", "b1", "bias", "g2", "b2")]
    nodes = [
        helper.make_node("SkipLayerNormalization", ["x", "s", "g1", "b1", "bias"], ["h", "", "", "sum"],
                         domain="com.microsoft", name="sln1", epsilon=1e-5),
        helper.make_node("SkipLayerNormalization", ["h", "sum", "g2", "b2"], ["y"], domain="com.microsoft",
                         name="sln2", epsilon=1e-5),
    ]
    g = helper.make_graph(nodes, "g", [x, s], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _ln(v, g, b, eps=1e-5):
    mu = v.mean(-1, keepdims=True)
    return (v - mu) / np.sqrt(((v - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b


def _run(model, feeds, disabled=()):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"],
                                **({"disabled_optimizers": list(disabled)} if disabled else {}))
    return sess.run(None, feeds)[0]


def test_split_graph_computes_the_same_as_the_fused_one_and_float64():
    rng = np.random.default_rng()
    model = _graph(rng)
    split, n = split_skip_layernorm(model)
    assert n == 2
    ops = [node.op_type for node in split.graph.node]
    assert "SkipLayerNormalization" not in ops and ops.count("LayerNormalization") == 2
    feeds = {"x": rng.standard_normal((2, 5, H)).astype(np.float32), "s": rng.standard_normal((2, 5, H)).astype(np.float32)}
    fused, unfused = _run(model, feeds), _run(split, feeds, DISABLED_OPTIMIZERS)
    p = {i.name: nh.to_array(i).astype(np.float64) for i in model.graph.initializer}
    total = feeds["x"].astype(np.float64) + feeds["s"] + p["bias"]
    ref = _ln(_ln(total, p["g1"], p["b1"]) + total, p["g2"], p["b2"])
    assert np.abs(unfused - ref).max() < 1e-4
    assert np.abs(unfused - fused).max() < 1e-4


def test_choose_times_both_and_records_it():
    model = _graph(np.random.default_rng(1))
    # the toy graph takes [2, 5, H] floats, not token ids: give choose a model over ids instead
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 32])
    model.graph.input.append(ids)
    cast = helper.make_node("Cast", ["input_ids"], ["idsf"], to=TensorProto.FLOAT)
    shape = nh.from_array(np.array([2, 5, H], dtype=np.int64), "shape")
    fill = helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
    red = helper.make_node("ReduceMean", ["idsf"], ["m"], keepdims=0)
    mul = helper.make_node("Mul", ["ones", "m"], ["x"])
    mul2 = helper.make_node("Mul", ["ones", "m"], ["s"])
    model.graph.initializer.append(shape)
    nodes = [cast, fill, red, mul, mul2] + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.input[:2]
    chosen, info = choose(model, vocab=30522, rounds=2, runs=5)
    assert set(info["median_ms_b1_s32"]) == {"fused", "split"} and all(v > 0 for v in info["median_ms_b1_s32"].values())
    kinds = {n.op_type for n in chosen.graph.node}
    assert ("SkipLayerNormalization" not in kinds) == info["split"]
    assert info["ort_disabled_optimizers"] == (DISABLED_OPTIMIZERS if info["split"] else [])
