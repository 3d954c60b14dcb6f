"""Nothing is captured or compiled while serving: the CUDA engine builds every shape
bucket in warm-up, and random traffic afterwards builds none (the metric stays 0)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from surge.types import TokenBatch
from tests.conftest import cosine_rows

pytestmark = pytest.mark.cuda


def test_warmup_builds_every_bucket_and_traffic_builds_none(model_dir, tokenizer, reference, sentences):
    from surge.engines.pooling import l2_normalize, pool
    from surge.engines.torch_gpu import TorchEngine

    engine = TorchEngine(device="cuda", precision="fp16", max_batch=64, max_tokens=8192)
    engine.load(model_dir)
    t0 = time.perf_counter()
    engine.warmup([(1, 16)])
    took = time.perf_counter() - t0
    print(f"warm-up: {engine.builds} buckets in {took:.1f} s")
    assert engine.builds == len(engine.buckets) and engine.builds_after_ready == 0
    rng = np.random.default_rng()
    for _ in range(300):
        n = int(rng.integers(1, 65))
        idx = rng.choice(len(sentences), n, replace=False)
        batch = TokenBatch.pack(tokenizer.encode([sentences[i] for i in idx]))
        got = l2_normalize(pool(engine.run(batch), batch, "mean"))
        assert cosine_rows(got.astype(np.float32), reference[idx]).min() >= 0.999
    assert engine.builds_after_ready == 0


def test_service_under_load_reports_zero_builds_after_ready(model_dir, sentences):
    from prometheus_client import CollectorRegistry

    from surge.config import BatchingConfig, CacheConfig, EngineConfig
    from surge.models import load_model_spec
    from surge.runtime.loader import build_worker
    from surge.runtime.service import ModelService

    spec = load_model_spec(model_dir)
    worker = build_worker(spec, None, EngineConfig(engine="torch", device="cuda", precision="fp16", instances=2),
                          batch_tokens=8192)
    reg = CollectorRegistry()
    svc = ModelService(spec.name, "1", worker, batching=BatchingConfig(), cache=CacheConfig(enabled=False),
                       metrics_registry=reg)
    svc.mark_ready()

    async def load():
        rng = np.random.default_rng()

        async def client(c):
            for _ in range(40):
                k = int(rng.integers(1, 9))
                await svc.embed(texts=[sentences[int(i)] for i in rng.choice(len(sentences), k)])

        await asyncio.gather(*(client(c) for c in range(64)))
        labels = {"model": spec.name, "version": "1"}
        found = (reg.get_sample_value("surge_engine_graph_builds_total", {**labels, "phase": "warmup"}),
                 reg.get_sample_value("surge_engine_graph_builds_total", {**labels, "phase": "serving"}))
        await svc.close()
        return found

    warm, after = asyncio.run(load())
    assert warm and warm >= 2 * len(worker.engines.engines[0].buckets)
    assert after == 0
