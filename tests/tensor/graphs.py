"""Small ONNX graphs built with onnx.helper (no export: milliseconds) for the tensor-model tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp_onnx(path: Path, seed: int = 0, dim: int = 8, hidden: int = 16, classes: int = 5) -> dict:
    """Inputs x FP32 [N, dim] and bias INT64 [N, 1]; outputs probs FP32 [N, classes], top INT64 [N].

    probs = softmax(relu(x @ w1 + b1) @ w2 + b2 + bias); top = argmax(probs)."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((dim, hidden)).astype(np.float32)
    b1 = rng.standard_normal(hidden).astype(np.float32)
    w2 = rng.standard_normal((hidden, classes)).astype(np.float32)
    b2 = rng.standard_normal(classes).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["l0"]),
        helper.make_node("Add", ["l0", "b2"], ["l1"]),
        helper.make_node("Cast", ["bias"], ["biasf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["l1", "biasf"], ["l2"]),
        helper.make_node("Softmax", ["l2"], ["probs"], axis=-1),
        helper.make_node("ArgMax", ["probs"], ["top"], axis=-1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dim]),
         helper.make_tensor_value_info("bias", TensorProto.INT64, ["N", 1])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", classes]),
         helper.make_tensor_value_info("top", TensorProto.INT64, ["N"])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return {"dim": dim, "classes": classes}


def fixed_onnx(path: Path, seed: int = 1) -> None:
    """A fixed-shape graph: x FP32 [2, 3] -> y FP32 [3] = sum over rows of tanh(x * w)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((2, 3)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "w"], ["m"]), helper.make_node("Tanh", ["m"], ["t"]),
             helper.make_node("ReduceSum", ["t", "axes"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "fixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def embed_onnx(path: Path, seed: int = 2, vocab: int = 10, dim: int = 4) -> np.ndarray:
    """ids INT64 [N, L] -> mean FP32 [N, dim]: mean of table rows (Gather: an id >= vocab is an error)."""
    table = np.random.default_rng(seed).standard_normal((vocab, dim)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
             helper.make_node("ReduceMean", ["rows", "axes"], ["mean"], keepdims=0)]
    graph = helper.make_graph(nodes, "embed", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "L"])],
                              [helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["N", dim])],
                              [numpy_helper.from_array(table, "table"),
                               numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return table
