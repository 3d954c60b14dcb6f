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
