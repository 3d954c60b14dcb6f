"""Double-buffered staging on one CUDA engine, pooling inside the graph (as served): two batches
in flight at once (one being packed and copied while the other runs) give each caller exactly
its own rows, the same bits as the batch run alone, and match the FP32 reference."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from surge.types import TokenBatch
from tests.conftest import cosine_rows

pytestmark = pytest.mark.cuda


def test_two_batches_in_flight_on_one_engine_never_mix(model_dir, tokenizer, reference, sentences):
    from surge.engines.pooling import l2_normalize
    from surge.engines.torch_gpu import TorchEngine
    from surge.runtime.worker import EnginePool

    engine = TorchEngine(device="cuda", precision="fp16", max_batch=64, max_tokens=8192, pipeline_depth=2)
    engine.load(model_dir)
    assert engine.attach_pooling("mean")
    engine.warmup([(1, 16)])
    pool_ = EnginePool([engine])
    assert pool_.slots == 2  # the engine is handed out twice
    rng = np.random.default_rng()
    jobs = []
    for _ in range(160):
        idx = rng.choice(len(sentences), int(rng.integers(1, 65)), replace=False)
        jobs.append((idx, TokenBatch.pack(tokenizer.encode([sentences[i] for i in idx]))))
    alone = [engine.run(b) for _, b in jobs]  # one at a time: the expected bits
    got: list = [None] * len(jobs)
    errors: list = []

    def worker(k: int):
        try:
            for j in range(k, len(jobs), 4):
                got[j] = pool_.run(jobs[j][1])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (idx, batch), a, g in zip(jobs, alone, got):
        assert g.shape == (len(idx), reference.shape[1])  # pooled rows, one per sentence
        np.testing.assert_array_equal(g, a)  # its own rows, bit for bit
        vec = l2_normalize(g)
        assert cosine_rows(vec.astype(np.float32), reference[idx]).min() >= 0.999
    assert engine.builds_after_ready == 0
    engine.close()


def test_served_path_pools_in_the_graph_launches_on_the_loop_and_matches_the_reference(model_dir, reference,
                                                                                      sentences):
    """The service as --workers' engine process builds it: pooling in the graph, two batches in
    flight, launch/collect on the event loop; 64 concurrent callers each get their own rows."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from surge.config import BatchingConfig, CacheConfig, EngineConfig
    from surge.engines import torch_gpu
    from surge.models import load_model_spec
    from surge.runtime.loader import build_worker
    from surge.runtime.service import ModelService

    spec = load_model_spec(model_dir)
    torch_gpu.DEFAULT_PIPELINE_DEPTH = 2
    try:
        worker = build_worker(spec, None, EngineConfig(engine="torch", device="cuda", precision="fp16"),
                              batch_tokens=8192)
    finally:
        torch_gpu.DEFAULT_PIPELINE_DEPTH = 1
    assert worker.engine_pools and worker.can_launch
    svc = ModelService(spec.name, "1", worker, batching=BatchingConfig(), cache=CacheConfig(enabled=False),
                       metrics_registry=CollectorRegistry())
    assert svc.batcher._split is not None
    svc.mark_ready()
    rng = np.random.default_rng()

    async def load():
        async def client():
            out = []
            for _ in range(20):
                idx = rng.choice(len(sentences), int(rng.integers(1, 5)), replace=False)
                res = await svc.embed(texts=[sentences[i] for i in idx])
                out.append((idx, res.vectors))
            return out

        got = await asyncio.gather(*(client() for _ in range(64)))
        await svc.close()
        return [x for g in got for x in g]

    results = asyncio.run(load())
    assert len(results) == 64 * 20
    for idx, vec in results:
        assert cosine_rows(vec.astype(np.float32), reference[idx]).min() >= 0.999
    assert max(r.size for r in svc.batcher.history) > 1  # batches formed
    assert worker.engines.engines[0].builds_after_ready == 0
