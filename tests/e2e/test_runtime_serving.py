"""The serving runtime end to end: a real `surge serve`, a real HTTP client.

- 10,000 requests of real sentences from 100 concurrent clients: every answer
  equals the same input computed alone; nothing lost, nothing mixed.
- Batches form under concurrency (and not with --no-batching).
- Overload answers 429 with Retry-After (gRPC: RESOURCE_EXHAUSTED with the hint
  in trailing metadata), timeouts answer 504 and their queued inputs are never
  computed; the server recovers. Deterministic: a test-only engine slow-down.
- Two server processes share cache hits through a real redis-server.
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from surge.types import EmbedOptions
from tests.http_load import closed_loop, encode_post
from tests.server_process import ServerProcess

STRAINED_DELAY_S = 3.0  # added to every engine batch of the strained server
STRAINED_TIMEOUT_S = 4.5  # its request timeout: one batch fits (1.5 s to spare), two do not


def metrics(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels without model/version): value} from GET /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "version")))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def start_all(*servers: ServerProcess) -> None:
    with ThreadPoolExecutor(len(servers)) as ex:
        list(ex.map(lambda s: s.start(), servers))


@pytest.fixture(scope="module")
def shared_tier(request):
    """The redis-server URL, or None when redis-server is not installed (only
    the shared-tier test is skipped then, not the whole module)."""
    try:
        return request.getfixturevalue("redis_server")
    except pytest.skip.Exception:
        return None


@pytest.fixture(scope="module")
def servers(shared_tier):
    redis_args = ["--redis-url", shared_tier] if shared_tier else []
    batched = ServerProcess(*redis_args, "--max-queue-delay-ms", "5")
    unbatched = ServerProcess("--no-batching", "--cache-bytes", "0")
    # Every batch of `strained` takes 3 s more than its compute (a test-only engine
    # slow-down) and a request times out after 4.5 s, so what gets 429, 504 or is dropped
    # follows from the arithmetic below, not from how fast this machine is.
    strained = ServerProcess("--cache-bytes", "0", "--max-queue-size", "48", "--max-batch-size", "16",
                             "--request-timeout-s", str(STRAINED_TIMEOUT_S), "--threads", "1",
                             env={"SURGE_TEST_ENGINE_DELAY_MS": str(int(STRAINED_DELAY_S * 1000))}, grpc=True)
    try:
        start_all(batched, unbatched, strained)
        yield batched, unbatched, strained
    finally:
        for s in (batched, unbatched, strained):
            s.stop()


@pytest.fixture(scope="module")
def phrases(sentences) -> list[str]:
    """Short real inputs: two random word prefixes of every sentence."""
    rng = random.Random(11)
    out = set()
    for s in sentences:
        words = s.split()
        for _ in range(2):
            out.add(" ".join(words[: rng.randint(3, min(9, len(words)))]))
    return sorted(out)


@pytest.fixture(scope="module")
def alone(bundled_worker, phrases) -> dict[str, np.ndarray]:
    """Each phrase computed alone (a batch of one) in this process."""
    w = bundled_worker
    return {p: w.finish(w.compute(w.tokenizer.encode([p])), EmbedOptions())[0] for p in phrases}


def test_10k_concurrent_requests_match_alone_results(servers, phrases, alone):
    batched = servers[0]
    rng = random.Random(1)
    n = 10_000
    plan = [[rng.choice(phrases) for _ in range(rng.randint(1, 2))] for _ in range(n)]
    # A lean keep-alive HTTP/1.1 client (httpx would spend more CPU than the server).
    wire = [encode_post("127.0.0.1", "/embed", {"inputs": p}) for p in plan]
    res = asyncio.run(closed_loop(batched.url, None, 100, total=n, make=wire.__getitem__, keep_bodies=True))
    assert res.statuses == {200: n}, res.statuses
    assert sorted(i for i, _ in res.bodies) == list(range(n)), "a request got no answer"
    worst = 0.0
    for i, raw in res.bodies:
        inputs, body = plan[i], orjson.loads(raw)
        got = np.asarray(body["embeddings"], dtype=np.float32)
        want = np.stack([alone[p] for p in inputs])
        assert got.shape == want.shape
        worst = max(worst, float(np.abs(got - want).max()))
    # Batched rows differ from alone rows only in rounding (padding), never by
    # another input's vector (which would be off by ~1).
    assert worst < 1e-4, worst
    m = metrics(batched.url)
    assert m[("surge_requests_total", ())] >= 10_000
    assert m[("surge_cache_hits_total", (("tier", "recent"),))] > 0


def _unique_inputs(phrases, tag: str, n: int) -> list[str]:
    # Real phrases made unique per request so that the cache cannot answer.
    return [f"{phrases[i % len(phrases)]} {tag}{i}" for i in range(n)]


def _concurrent(url: str, inputs: list[str], n_clients: int):
    wire = [encode_post("127.0.0.1", "/embed", {"inputs": [t]}) for t in inputs]
    res = asyncio.run(closed_loop(url, None, n_clients, total=len(wire), make=wire.__getitem__))
    assert res.statuses == {200: len(wire)}, res.statuses


def test_batches_form_under_64_clients_and_not_with_batching_off(servers, phrases):
    batched, unbatched, _ = servers
    for srv, tag in ((batched, "b"), (unbatched, "u")):
        before = metrics(srv.url)
        _concurrent(srv.url, _unique_inputs(phrases, tag, 256), 64)
        after = metrics(srv.url)
        n = after[("surge_batch_size_count", ())] - before.get(("surge_batch_size_count", ()), 0)
        inputs = after[("surge_batch_size_sum", ())] - before.get(("surge_batch_size_sum", ()), 0)
        assert inputs == 256
        if srv is batched:
            assert n < inputs / 2, f"{n} batches for {inputs} inputs"
            # The delay bound shows in the queue-latency histogram too: most
            # inputs leave the queue in well under a second.
            assert after[("surge_queue_latency_seconds_count", ())] >= 256
        else:
            assert n == inputs


def test_overload_gives_429_timeouts_give_504_and_the_server_recovers(servers, sentences, alone, phrases):
    """Deterministic: every batch takes >= 3 s and a request times out after 4.5 s.

    Seven requests of 8 inputs of one length are admitted (56 inputs: the first
    batch takes 8 or 16, the queue of 48 holds the rest). While they are all in
    flight (the first batch holds the engine for 3 s), requests of 16 more inputs
    pass the admission bound (48 queued + one batch of 16 = 64): HTTP gets 429,
    gRPC RESOURCE_EXHAUSTED, both with a retry hint. The first batch answers at
    3 s; the second runs from 3 s to 6 s, past the timeout: 504; every input still
    queued at 4.5 s expires there: 504, never computed.
    """
    from surge.server.grpc import grpc_service_pb2 as pb
    from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc

    strained = servers[2]
    # Unique (no cache, no coalescing) and all of one token length (no padding rule splits a batch).
    words = ["red", "blue", "green", "black", "white", "brown", "cat", "dog", "fish", "bird", "tree", "house"]
    texts = [f"the {a} and the {b} and the {c}" for a in words for b in words for c in words][:104]

    def inflight() -> float:
        return metrics(strained.url).get(("surge_inflight_inputs", ()), 0.0)

    async def flood():
        async with httpx.AsyncClient(base_url=strained.url, timeout=30,
                                     limits=httpx.Limits(max_connections=64)) as client:
            first = [asyncio.ensure_future(client.post("/embed", json={"inputs": texts[i:i + 8]}))
                     for i in range(0, 56, 8)]
            # All 56 inputs admitted (the engine is still on the first batch for 3 s):
            # from here on 16 more are over the bound.
            while await asyncio.to_thread(inflight) < 56:
                assert not any(f.done() for f in first), [f.result().status_code for f in first if f.done()]
                await asyncio.sleep(0.01)
            refused = await asyncio.gather(*(client.post("/embed", json={"inputs": texts[i:i + 16]})
                                             for i in range(56, 88, 16)))
            async with grpc.aio.insecure_channel(strained.grpc_url) as channel:
                req = pb.ModelInferRequest(model_name="all-MiniLM-L6-v2")
                req.inputs.add(name="text", datatype="BYTES", shape=[16]).contents.bytes_contents.extend(
                    t.encode() for t in texts[88:104])
                try:
                    await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
                    grpc_error = None
                except grpc.aio.AioRpcError as exc:
                    grpc_error = exc
            return await asyncio.gather(*first), refused, grpc_error

    before = metrics(strained.url)
    first, refused, grpc_error = asyncio.run(flood())
    assert [r.status_code for r in refused] == [429] * 2, [r.text for r in refused]
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
    # gRPC's overload answer carries the same hint in its trailing metadata.
    assert grpc_error is not None and grpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, grpc_error
    trailers = dict(grpc_error.trailing_metadata() or ())
    assert int(trailers["retry-after"]) >= 1, trailers
    assert int(trailers["grpc-retry-pushback-ms"]) == 1000 * int(trailers["retry-after"]), trailers
    codes = [r.status_code for r in first]
    assert set(codes) <= {200, 504}, codes
    assert 1 <= codes.count(200) <= 2, codes  # the first batch: 8 or 16 inputs
    assert codes.count(504) >= 5, codes
    for r in first:
        if r.status_code == 504:
            assert r.json()["error"]["code"] == "timeout"
    assert strained.alive()
    # Recovery: once the second batch has left the engine (a running batch cannot be
    # interrupted), the next request is answered, and right.
    deadline = time.monotonic() + 60
    attempts = 0
    while True:
        attempts += 1
        r = httpx.post(strained.url + "/embed", json={"inputs": [phrases[0]]}, timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["embeddings"][0], alone[phrases[0]], atol=1e-4)
    after = metrics(strained.url)
    dropped = sum(v for (name, _), v in after.items() if name == "surge_inputs_dropped_total") - sum(
        v for (name, _), v in before.items() if name == "surge_inputs_dropped_total")
    computed = after[("surge_batch_size_sum", ())] - before.get(("surge_batch_size_sum", ()), 0)
    # Queued past the deadline: at least 56 - 2 batches of 16 = 24 inputs were never computed.
    assert dropped >= 24, (dropped, computed)
    # What timed out in the queue was never computed (each recovery attempt is one input).
    assert computed + dropped <= 56 + attempts, (computed, dropped, attempts)


def test_redis_tier_shares_hits_between_two_servers(servers, phrases, shared_tier):
    if shared_tier is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    redis_server = shared_tier
    batched = servers[0]
    texts = _unique_inputs(phrases, "shared", 12)
    first = httpx.post(batched.url + "/embed", json={"inputs": texts}, timeout=30).json()["embeddings"]
    with ServerProcess("--redis-url", redis_server) as replica:
        before = metrics(replica.url)
        second = httpx.post(replica.url + "/embed", json={"inputs": texts}, timeout=30).json()["embeddings"]
        after = metrics(replica.url)
    np.testing.assert_array_equal(np.asarray(second), np.asarray(first))
    hits = after[("surge_cache_hits_total", (("tier", "shared"),))] - before.get(
        ("surge_cache_hits_total", (("tier", "shared"),)), 0)
    assert hits == 12
    assert after.get(("surge_batch_size_sum", ()), 0) == before.get(("surge_batch_size_sum", ()), 0)


def test_cache_hit_answers_equal_the_full_path_answers(servers, phrases):
    batched = servers[0]
    for path, key in (("/embed", "inputs"), ("/v1/embeddings", "input")):
        texts = _unique_inputs(phrases, f"hot{key}", 3)
        miss = httpx.post(batched.url + path, json={key: texts}, timeout=30)
        hit = httpx.post(batched.url + path, json={key: texts}, timeout=30)  # answered from the cache
        assert miss.status_code == hit.status_code == 200
        assert hit.json() == miss.json()
        assert hit.headers["x-surge-model-version"] == miss.headers["x-surge-model-version"]
        assert hit.headers["content-type"] == "application/json"
    # The hot path answers plain misses itself: the same bytes as the FastAPI routes give
    # (forced here by an option at its default value, which the hot path leaves to the route).
    for path, key, extra in (("/embed", "inputs", {"truncate": True}), ("/v1/embeddings", "input", {"dimensions": None})):
        texts = _unique_inputs(phrases, f"direct{key}", 3)
        direct = httpx.post(batched.url + path, json={key: texts}, timeout=30)
        routed = httpx.post(batched.url + path, json={key: texts, **extra}, timeout=30)
        assert direct.status_code == routed.status_code == 200
        assert direct.content == routed.content
        assert direct.headers["x-surge-model-version"] == routed.headers["x-surge-model-version"]
    # Requests the hot path does not handle still get the routes' errors.
    bad = httpx.post(batched.url + "/embed", json={"inputs": [""]}, timeout=30)
    assert bad.status_code == 400


def test_a_client_that_disconnects_is_not_computed(servers, sentences):
    batched = servers[0]
    texts = [f"{' '.join(sentences[i:i + 4])} gone{i}" for i in range(192)]
    before = metrics(batched.url)

    async def impatient():
        async with httpx.AsyncClient(base_url=batched.url, timeout=0.3) as client:
            return await asyncio.gather(*(client.post("/embed", json={"inputs": texts[i:i + 32]})
                                          for i in range(0, 192, 32)), return_exceptions=True)

    outcomes = asyncio.run(impatient())
    assert all(isinstance(o, httpx.TimeoutException) for o in outcomes), outcomes
    # The server's own timeout is 30 s: only the disconnect can stop this work.
    deadline = time.monotonic() + 20
    while metrics(batched.url)[("surge_inflight_inputs", ())] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = metrics(batched.url)
    key = ("surge_inputs_dropped_total", (("reason", "cancelled"),))
    dropped = after.get(key, 0) - before.get(key, 0)
    computed = after[("surge_batch_size_sum", ())] - before[("surge_batch_size_sum", ())]
    assert dropped > 0
    assert computed + dropped <= 192 and computed < 192


def test_metrics_cover_the_runtime_per_model_and_version(servers, phrases):
    url = servers[0].url
    for _ in range(2):  # a miss, then a hit
        assert httpx.post(url + "/embed", json={"inputs": [phrases[1]]}, timeout=30).status_code == 200
    bad = httpx.post(url + "/embed", json={"inputs": [phrases[1]], "dimensions": 100_000}, timeout=30)
    assert bad.status_code == 400  # refused inside the runtime: counted as a failure
    text = httpx.get(url + "/metrics", timeout=10).text
    names = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            names.setdefault(s.name, s.labels)
    for name in ("surge_requests_total", "surge_request_failures_total", "surge_request_latency_seconds_bucket",
                 "surge_queue_latency_seconds_bucket", "surge_tokenize_latency_seconds_bucket",
                 "surge_compute_latency_seconds_bucket", "surge_batch_size_bucket", "surge_batch_tokens_bucket",
                 "surge_batch_padding_ratio_bucket", "surge_queue_depth", "surge_cache_hits_total",
                 "surge_cache_misses_total", "surge_cache_evictions_total", "surge_cache_bytes"):
        assert name in names, name
        assert names[name]["model"] == "all-MiniLM-L6-v2" and names[name]["version"] == "1", name
