"""An ONNX model's `engine.instances` (config.pbtxt's instance_group count) runs that many batches at once on its
session (ONNX Runtime's run is thread-safe), as Triton's instances do; it was read, then replaced by 1 (the config
said count 1). Every request's result still equals onnxruntime's on that request alone."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import onnxruntime as ort

from surge.config import BatchingConfig, EngineConfig
from surge.models.tensor_config import TensorModelOptions
from surge.runtime.tensor_loader import build_tensor_service
from tests.tensor.graphs import mlp_onnx


def test_instances_run_batches_side_by_side_and_each_request_gets_its_own_rows(tmp_path):
    path = tmp_path / "mlp" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    mlp_onnx(path, seed=3)
    service = build_tensor_service("mlp", "1", "onnx", path, TensorModelOptions(), EngineConfig(threads=1,
                                   instances=3), BatchingConfig(max_batch_size=4, max_queue_delay_ms=1), None, None)
    sess = ort.InferenceSession(str(path))
    rng = np.random.default_rng(5)
    requests = [{"x": rng.standard_normal((n, 8)).astype(np.float32),
                 "bias": rng.integers(0, 3, (n, 1)).astype(np.int64)} for n in rng.integers(1, 4, 60)]
    # the first two batches wait for each other: they meet only if two run at once (one instance: the
    # barrier breaks after its timeout and the test fails)
    both = threading.Barrier(2, timeout=60)
    calls = []
    run = service.backend.engine.run

    def watched(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            both.wait()
        return run(*args, **kwargs)

    service.backend.engine.run = watched

    async def main():
        service.mark_ready()
        try:
            return await asyncio.gather(*(service.infer(r) for r in requests))
        finally:
            await service.close()

    results = asyncio.run(main())
    assert service.config.instances == 3 and service.config.triton_config()["instance_group"][0]["count"] == 3
    assert not both.broken
    for req, res in zip(requests, results):
        np.testing.assert_allclose(res.outputs["probs"], sess.run(["probs"], req)[0], rtol=1e-5, atol=1e-6)
