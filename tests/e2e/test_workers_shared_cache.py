"""`surge serve --workers 2` with the cache on: a query one front end answered is a hit in the other
(the shared-memory table, runtime/shm_cache.py), with the same vector; real processes, real HTTP."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.conftest import cosine_rows
from tests.server_process import ServerProcess, fresh_client

pytestmark = pytest.mark.timeout(300)


def _sample(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_query_answered_by_one_front_end_is_a_hit_in_the_other(sentences, reference_embed):
    texts = sentences[40:64]
    ref = reference_embed(texts)
    # --engine-connections 0: every connection stays with a front end (by default one at a time is
    # handed to the engine process, which would serve all of these sequential ones itself).
    with ServerProcess("--workers", "2", "--engine", "torch", "--device", "cpu", "--max-batch-size", "16",
                       "--engine-connections", "0") as srv:
        first = {}
        answers = []
        for rnd in range(7):  # a fresh connection each time: the kernel spreads them over both front ends
            for i, t in enumerate(texts):
                with fresh_client(srv.url, timeout=60) as c:
                    r = c.post("/embed", json={"inputs": [t]})
                assert r.status_code == 200, r.text
                vec = np.array(r.json()["embeddings"][0], np.float32)
                first.setdefault(i, vec)
                answers.append((i, vec))
        metrics = httpx.get(srv.url + "/metrics", headers={"connection": "close"}, timeout=30).text
    for i, vec in answers:  # every answer, computed or from any tier, is the first one
        np.testing.assert_array_equal(vec, first[i])
    assert cosine_rows(np.stack([first[i] for i in range(len(texts))]), ref).min() >= 0.9999
    shm_hits = _sample(metrics, "surge_cache_hits_total", tier="shm")
    assert shm_hits >= 1, [ln for ln in metrics.splitlines() if ln.startswith("surge_cache_hits_total")]
    # at most one miss per text and front end: 24 texts, 2 front ends
    assert _sample(metrics, "surge_cache_misses_total") <= 2 * len(texts)
