"""A load that fails after the loader built the service (its warm-up fails) frees that build:
its batcher, worker threads, engine and metrics series must not outlive the failed load."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surge.config import BatchingConfig, EngineConfig
from surge.errors import EngineError
from surge.runtime.registry import ModelRegistry
from surge.runtime.repository import ModelRepository
from surge.runtime.tensor_loader import build_tensor_service, model_path


def _warmfail_onnx(path) -> None:
    """ids INT64 [N, 1] -> rows of a 1-row table: warm-up's random ids (0 or 1; seed 0 draws a 1) fail."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0)]
    graph = helper.make_graph(nodes, "warmfail", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 1])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["N", 1, 8])],
                              [numpy_helper.from_array(np.ones((1, 8), np.float32), "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def test_a_failed_warm_up_closes_the_built_service(tmp_path):
    _warmfail_onnx(tmp_path / "warmfail" / "1" / "model.onnx")
    (tmp_path / "warmfail" / "1" / "model.yaml").write_text("kind: onnx\n")
    built = []

    def loader(entry):  # the real builder; the services are kept to look at after the load
        service = build_tensor_service(entry.name, entry.version, entry.config.kind,
                                       model_path(entry.dir, entry.config.kind, entry.config.tensor),
                                       entry.config.tensor, EngineConfig(threads=1), BatchingConfig(), None, None)
        built.append(service)
        return service

    def pool_threads() -> int:  # the service's executor threads (named after the model)
        return sum(t.name.startswith("surge-warmfail-tensor") for t in threading.enumerate())

    async def run():
        repo = ModelRepository(tmp_path, ModelRegistry(), loader)
        for _ in range(3):
            with pytest.raises(EngineError, match="failed to load"):
                await repo.load("warmfail")
        threads = pool_threads()
        await repo.close()
        return threads

    threads = asyncio.run(run())
    assert len(built) == 3
    assert threads == 0, f"{threads} worker threads of failed loads still alive"
    for service in built:
        assert not service.ready, "a service whose load failed was left open"
        assert service.batcher._closed
