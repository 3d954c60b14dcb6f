"""StackedBackend (onnx, torch): requests stacked into one run are split back by their row
offsets, which is only right when every output has one row per stacked input row. A graph
whose dynamic first output dim is not the batch must not hand one request's rows to another."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from surge.engines.tensor_onnx import OnnxTensorEngine
from surge.runtime.tensor_service import StackedBackend


def _compress_onnx(path) -> None:
    """x FP32 [N, 4] -> y FP32 [M, 4]: the rows of x whose first column is > 0 (M <= N is not the batch)."""
    nodes = [helper.make_node("Gather", ["x", "zero"], ["c0"], axis=1),
             helper.make_node("Greater", ["c0", "zf"], ["cond"]),
             helper.make_node("Compress", ["x", "cond"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "compress", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 4])],
                              [numpy_helper.from_array(np.array(0, np.int64), "zero"),
                               numpy_helper.from_array(np.array(0, np.float32), "zf")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_outputs_not_one_row_per_input_row_are_never_split_across_requests(tmp_path):
    path = tmp_path / "compress.onnx"
    _compress_onnx(path)
    engine = OnnxTensorEngine(threads=1)
    engine.load(path)
    backend = StackedBackend(engine, batched=True)
    try:
        # One row each; the even ones are filtered out by the graph (0 rows), the odd ones kept (1 row).
        reqs = []
        for i in range(6):
            x = np.full((1, 4), float(i), np.float32)
            x[0, 0] = -1.0 if i % 2 == 0 else 1.0
            reqs.append({"x": x})
        together = backend.run_requests(reqs)
        alone = [backend.run_requests([r])[0] for r in reqs]
        for i, (r, got, own) in enumerate(zip(reqs, together, alone)):
            # A result never depends on which requests shared its batch: it is what the request gets alone.
            np.testing.assert_array_equal(got["y"], own["y"], err_msg=f"request {i} got another request's rows")
            np.testing.assert_array_equal(got["y"], r["x"][r["x"][:, 0] > 0])
    finally:
        backend.close()
