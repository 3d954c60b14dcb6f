"""benchmarks/int8_op_profile.py: ONNX Runtime's profile of a real (small) model, by operator."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import int8_op_profile as P  # noqa: E402


def test_each_operator_of_the_model_gets_its_time_a_run(tmp_path):
    rng = np.random.default_rng()
    length = int(rng.integers(4, 12))
    w = numpy_helper.from_array(rng.standard_normal((length, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["x"], to=TensorProto.FLOAT),
         helper.make_node("MatMul", ["x", "w"], ["y"]),
         helper.make_node("Abs", ["y"], ["out"])],
        "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", length])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "model.onnx"))
    ids = rng.integers(0, 100, (3, length)).astype(np.int64)
    wall, ops = P.profile(str(tmp_path), ids, np.ones_like(ids), runs=4, threads=1)
    assert wall > 0
    assert {"Cast", "MatMul", "Abs"} <= set(ops) and all(v > 0 for v in ops.values())
    assert set(ops) <= {"Cast", "MatMul", "Abs"}  # nothing but the graph's own operators
