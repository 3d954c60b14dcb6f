"""TEI's /embed_all on the CUDA engine as served: its graphs pool (attach_pooling), and the hidden state comes
from TorchEngine.run_hidden, which runs the same forward without pooling and without a pipeline slot, while
the batcher launches pooled batches on its event loop.

Checked against transformers' FP32 last_hidden_state (SURGE_GPU_HIDDEN_REF: benchmarks/gpu_prepare.py's
hidden_fp32.npz, where transformers is not installed), with /embed traffic in flight: every token's rows
match, a text's rows are the same bits alone and among other inputs, the pooled answers stay right, and no
graph is captured after warm-up.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest import cosine_rows
from tests.reference import hidden_state_texts

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def hidden_reference(model_dir, sentences):
    env = os.environ.get("SURGE_GPU_HIDDEN_REF")
    if env:
        data = np.load(env)
        return [data[f"arr_{i}"] for i in range(len(data.files))]
    from surge.models import load_model_spec
    from tests.reference import TorchReference

    return TorchReference(load_model_spec(model_dir)).last_hidden_states(hidden_state_texts(sentences))


def test_embed_all_where_the_graphs_pool_is_every_tokens_hidden_state(model_dir, reference, hidden_reference,
                                                                      sentences):
    import asyncio

    from prometheus_client import CollectorRegistry

    from surge.config import BatchingConfig, CacheConfig, EngineConfig
    from surge.engines import torch_gpu
    from surge.models import load_model_spec
    from surge.runtime.loader import build_worker
    from surge.runtime.service import ModelService

    texts = hidden_state_texts(sentences)
    spec = load_model_spec(model_dir)
    torch_gpu.DEFAULT_PIPELINE_DEPTH = 2  # as --workers' engine process: two batches in flight per instance
    try:
        worker = build_worker(spec, None, EngineConfig(engine="torch", device="cuda", precision="fp16"),
                              batch_tokens=8192)
    finally:
        torch_gpu.DEFAULT_PIPELINE_DEPTH = 1
    assert worker.engine_pools and worker.can_launch and worker.can_return_tokens
    svc = ModelService(spec.name, "1", worker, batching=BatchingConfig(), cache=CacheConfig(enabled=False),
                       metrics_registry=CollectorRegistry())
    svc.mark_ready()
    rng = np.random.default_rng()

    async def run():
        async def embeds():
            out = []
            for _ in range(20):
                idx = rng.choice(len(sentences), int(rng.integers(1, 5)), replace=False)
                out.append((idx, (await svc.embed(texts=[sentences[i] for i in idx])).vectors))
            return out

        async def states():
            return [await svc.token_states(texts, truncate=True) for _ in range(4)]

        # 32 callers of /embed keep both pipeline slots busy while the token states run: a hang fails here
        got = await asyncio.wait_for(asyncio.gather(states(), *(embeds() for _ in range(32))), 300)
        alone = [(await svc.token_states([t], truncate=True))[0] for t in texts]
        await svc.close()
        return got[0], [x for g in got[1:] for x in g], alone

    answers, pooled, alone = asyncio.run(run())
    for rows in answers:
        assert len(rows) == len(texts)
        for got, want, single in zip(rows, hidden_reference, alone):
            assert got.shape == want.shape  # [tokens incl. [CLS] and [SEP], 384]: the long text truncated
            assert cosine_rows(got, want).min() >= 0.999
            np.testing.assert_array_equal(got, single)  # the same bits whatever else the request holds
    for idx, vec in pooled:
        assert cosine_rows(vec.astype(np.float32), reference[idx]).min() >= 0.999
    assert worker.engines.engines[0].builds_after_ready == 0
