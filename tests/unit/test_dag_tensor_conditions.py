"""A pipeline's `when:` condition tests one value against its `in:` list. A tensor model's output
is an array: one of a single element is tested as that element; one that cannot hold a single
element (its declared dims) is refused when the pipeline loads; one that turns out to hold several
for a request fails that request with a 422 naming the node, never an "array truth value" 500."""

from __future__ import annotations

import asyncio
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surge.config import BatchingConfig, EngineConfig
from surge.errors import ConfigError, Unprocessable
from surge.models.tensor_config import TensorModelOptions
from surge.runtime.dag import load_pipeline
from surge.runtime.registry import ModelRegistry
from surge.runtime.tensor_loader import build_tensor_service
from tests.tensor.graphs import mlp_onnx


def _double_onnx(path) -> None:
    """x FP32 [N, L] -> y = 2x (a per-item output of any length)."""
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "double",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "L"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "L"])],
                              [numpy_helper.from_array(np.array(2, np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _run(tmp_path, pipeline: str, body):
    mlp_onnx(tmp_path / "mlp.onnx")
    _double_onnx(tmp_path / "double.onnx")
    (tmp_path / "pipeline.yaml").write_text(textwrap.dedent(pipeline))

    async def main():
        registry, services = ModelRegistry(), []
        for name in ("mlp", "double"):
            s = build_tensor_service(name, "1", "onnx", tmp_path / f"{name}.onnx", TensorModelOptions(),
                                     EngineConfig(threads=1), BatchingConfig(max_queue_delay_ms=1), None, None)
            s.mark_ready()
            registry.add(s)
            services.append(s)
        try:
            return await body(lambda: load_pipeline("p", tmp_path / "pipeline.yaml", registry))
        finally:
            for s in services:
                await s.close()

    return asyncio.run(main())


def test_a_condition_on_an_output_of_several_elements_is_refused_at_load(tmp_path):
    pipeline = """
    inputs: {x: any, bias: any}
    nodes:
      - {name: m, model: mlp, inputs: {x: input.x, bias: input.bias}}
      - {name: again, model: mlp, inputs: {x: input.x, bias: input.bias}, when: {input: m.probs, in: [1]}}
    outputs: {top: again.top}
    """

    async def body(load):
        with pytest.raises(ConfigError) as e:
            await load()
        return e.value.message

    message = _run(tmp_path, pipeline, body)
    assert "nodes[1].when.input" in message and "m.probs" in message and "[5]" in message, message


def test_one_element_outputs_are_tested_as_their_value_and_longer_ones_fail_the_request(tmp_path):
    pipeline = """
    inputs: {x: any}
    nodes:
      - {name: d, model: double, inputs: {x: input.x}}
      - {name: again, model: double, inputs: {x: d.y}, when: {input: d.y, in: [4]}}
    outputs: {y: again.y}
    """

    async def body(load):
        p = await load()
        runs = await asyncio.gather(p.run({"x": [2.0]}), p.run({"x": [3.0]}))
        with pytest.raises(Unprocessable) as e:
            await p.run({"x": [2.0, 3.0]})
        return runs, e.value.message

    (ran, skipped), message = _run(tmp_path, pipeline, body)
    assert ran["outputs"]["y"] == [8.0] and skipped["outputs"]["y"] is None
    assert "node 'again'" in message and "d.y" in message and "[2]" in message, message
