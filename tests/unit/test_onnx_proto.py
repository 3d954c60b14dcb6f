"""engines/onnx_proto.py: copies and in-place trims of ONNX protobufs, checked against the plain
protobuf copy on a graph with every kind of field set."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from onnx import numpy_helper as nh

from surge.engines.onnx_proto import copy_model, drop_initializers


def _model(rng) -> onnx.ModelProto:
    inits = [nh.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"w{i}") for i in range(5)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"y{i - 1}", f"w{i}"], [f"y{i}"], name=f"mm{i}")
             for i in range(5)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y4", onnx.TensorProto.FLOAT, [2, 8])], inits,
                              doc_string="a chain", value_info=[helper.make_tensor_value_info("y0", 1, [2, 8])])
    model = helper.make_model(graph, producer_name="test", opset_imports=[helper.make_opsetid("", 18)])
    helper.set_model_props(model, {"k": "v"})
    return model


def test_copy_without_skips_equals_the_protobuf_copy_and_is_independent():
    model = _model(np.random.default_rng(0))
    copy = copy_model(model)
    assert copy.SerializeToString() == model.SerializeToString()
    copy.graph.initializer[0].float_data.append(1.0)
    copy.graph.node[0].name = "changed"
    assert model.graph.node[0].name == "mm0" and not model.graph.initializer[0].float_data


def test_copy_leaves_out_exactly_the_skipped_initializers():
    model = _model(np.random.default_rng(1))
    copy = copy_model(model, skip_initializers={"w1", "w3", "absent"})
    assert [i.name for i in copy.graph.initializer] == ["w0", "w2", "w4"]
    assert [i.name for i in model.graph.initializer] == [f"w{i}" for i in range(5)]  # the source keeps them
    for name in ("w0", "w2", "w4"):
        a = nh.to_array(next(i for i in copy.graph.initializer if i.name == name))
        assert np.array_equal(a, nh.to_array(next(i for i in model.graph.initializer if i.name == name)))
    # everything else as the full copy has it
    full = onnx.ModelProto.FromString(model.SerializeToString())
    drop_initializers(full.graph, lambda i: i.name in {"w1", "w3"})
    assert copy.SerializeToString() == full.SerializeToString()


def test_drop_deletes_in_place_keeps_the_order_and_counts():
    model = _model(np.random.default_rng(2))
    before = {i.name: nh.to_array(i) for i in model.graph.initializer}
    assert drop_initializers(model.graph, lambda i: i.name in {"w0", "w4"}) == 2
    assert [i.name for i in model.graph.initializer] == ["w1", "w2", "w3"]
    assert all(np.array_equal(nh.to_array(i), before[i.name]) for i in model.graph.initializer)
    assert drop_initializers(model.graph, lambda i: False) == 0 and len(model.graph.initializer) == 3
