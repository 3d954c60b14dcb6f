"""`--workers` front ends' cheap path (server/http/frontend.py, runtime/metrics_buffer.py): the
guarantees stay. A real supervisor with two front ends and a slowed engine process (every batch
takes 1.5 s more, a test-only setting), so the numbers below follow from arithmetic, not speed:

- a client that goes away is noticed through the front end's disconnect callback and its queued
  inputs are dropped in the engine process, not computed;
- per-request metrics, written once per loop pass, stay whole across processes: /metrics counts
  every request exactly once, whichever front end served it and whichever one is scraped;
- the hot path's bytes equal the routes' and match the reference.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from tests.conftest import cosine_rows
from tests.e2e.test_runtime_serving import metrics
from tests.server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)

DELAY_MS = 1500


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--workers", "2", "--engine", "torch", "--device", "cpu", "--cache-bytes", "0",
                       "--max-batch-size", "16", env={"SURGE_TEST_ENGINE_DELAY_MS": str(DELAY_MS)}) as srv:
        yield srv


def _settle(url: str, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m.get(("surge_inflight_inputs", ()), 0) <= 0 or time.monotonic() > end:
            return m
        time.sleep(0.1)


def test_a_client_that_disconnects_is_not_computed(server, sentences):
    texts = [f"{sentences[i % len(sentences)]} left{i}" for i in range(160)]
    before = _settle(server.url)

    async def impatient():
        async with httpx.AsyncClient(base_url=server.url, timeout=0.4) as client:
            return await asyncio.gather(*(client.post("/v1/embeddings", json={"input": texts[i:i + 16]})
                                          for i in range(0, 160, 16)), return_exceptions=True)

    outcomes = asyncio.run(impatient())
    assert all(isinstance(o, httpx.TimeoutException) for o in outcomes), outcomes
    after = _settle(server.url)
    key = ("surge_inputs_dropped_total", (("reason", "cancelled"),))
    dropped = after.get(key, 0) - before.get(key, 0)
    computed = after[("surge_batch_size_sum", ())] - before[("surge_batch_size_sum", ())]
    # 10 batches of 16 would take 15 s of engine time; the clients left after 0.4 s.
    assert dropped > 0
    assert computed + dropped <= 160 and computed < 160
    assert after[("surge_inflight_inputs", ())] == 0


def test_metrics_count_every_request_once_across_front_ends(server, sentences):
    before = _settle(server.url)
    n = 24

    async def many():
        # A new connection per request: the kernel spreads them over both front ends.
        async def one(i):
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                return await c.post("/v1/embeddings", json={"input": [sentences[i], sentences[i + 1]]})
        return await asyncio.gather(*(one(i) for i in range(n)))

    assert all(r.status_code == 200 for r in asyncio.run(many()))
    for _ in range(3):  # whichever front end answers the scrape
        after = metrics(server.url)
        assert after[("surge_requests_total", ())] - before[("surge_requests_total", ())] == n
        assert after[("surge_inputs_total", ())] - before[("surge_inputs_total", ())] == 2 * n
        for h in ("surge_request_latency_seconds", "surge_tokenize_latency_seconds",
                  "surge_postprocess_latency_seconds"):
            assert after[(h + "_count", ())] - before[(h + "_count", ())] == n, h
            buckets = {k: v for k, v in after.items() if k[0] == h + "_bucket"}
            assert max(buckets.values()) == after[(h + "_count", ())], h  # +Inf bucket holds every one
        assert after[("surge_inflight_inputs", ())] == 0


def test_hot_path_bytes_equal_the_routes_and_the_reference(server, sentences, reference_embed):
    texts = [sentences[3], sentences[7] + " Ünïcode, tabs\tand\nlines."]
    plain = httpx.post(server.url + "/v1/embeddings", json={"input": texts}, timeout=60)
    routed = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "dimensions": None}, timeout=60)
    assert plain.status_code == routed.status_code == 200
    assert plain.content == routed.content
    got = np.array([d["embedding"] for d in plain.json()["data"]], dtype=np.float32)
    assert cosine_rows(got, reference_embed(texts)).min() > 0.999
    with httpx.Client(base_url=server.url, timeout=60) as c:  # keep-alive: two on one connection
        a, b = (c.post("/embed", json={"inputs": t}) for t in texts)
    assert a.status_code == b.status_code == 200
    assert np.allclose(a.json()["embeddings"][0], got[0], atol=1e-6)
    assert np.allclose(b.json()["embeddings"][0], got[1], atol=1e-6)
