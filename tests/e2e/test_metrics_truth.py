"""/metrics tells the truth about what clients saw: a real `surge serve`, real clients.

Each test reads the counters before and after its own requests (prometheus_client's parser) and
asserts the deltas: one client request is one `surge_requests_total`, one latency observation, its
cache hits counted once, and a refused request one failure under its code.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests import metrics_scrape
from tests.http_reload import infer_across_a_reload
from tests.metrics_scrape import delta
from tests.server_process import ServerProcess

MODEL = "all-MiniLM-L6-v2"


def scrape(url: str) -> dict[tuple, float]:
    return metrics_scrape.scrape(url, MODEL, unlabelled=True)


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-queue-delay-ms", "1", "--threads", "1") as srv:
        yield srv


# the per-model series a request moves (the cache's gauges included: what the cache holds)
TRAFFIC = ("surge_requests_total", "surge_inputs_total", "surge_request_latency_seconds_count",
           "surge_queue_latency_seconds_count", "surge_tokenize_latency_seconds_count",
           "surge_compute_latency_seconds_count", "surge_postprocess_latency_seconds_count",
           "surge_batch_size_count", "surge_batch_tokens_count", "surge_batch_padding_ratio_count",
           "surge_cache_hits_total", "surge_cache_misses_total", "surge_inputs_coalesced_total",
           "surge_cache_entries")


def traffic(url: str) -> dict[str, float]:
    got = scrape(url)
    return {name: sum(v for (n, _), v in got.items() if n == name) for name in TRAFFIC}


@pytest.mark.parametrize("mode", [(), ("--workers", "2")], ids=["one-process", "workers"])
def test_the_warm_up_is_no_traffic_on_metrics(mode):
    """Before any request the warm-up (one input through the whole path) showed one cache miss, one batch
    and its latencies while requests said 0; it counts nowhere (nor is its text cached), and the first
    client request then counts as one request, one miss, one batch."""
    with ServerProcess("--threads", "1", *mode) as srv:
        assert traffic(srv.url) == dict.fromkeys(TRAFFIC, 0.0)
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.post("/embed", json={"inputs": "turn on the kitchen lights"}).status_code == 200
        want = dict.fromkeys(TRAFFIC, 1.0)
        want.update(surge_cache_hits_total=0.0, surge_inputs_coalesced_total=0.0)
        # Counted right after the answer is written (under --workers by the engine process, whose series the
        # front end reads back): a scrape that comes first may miss what is still being counted (CI, loaded:
        # the latencies read 0), so it is read again until the counts settle; they must then be the one request.
        deadline = time.monotonic() + 30
        while (after := traffic(srv.url)) != want and time.monotonic() < deadline:
            time.sleep(0.1)
    assert after == want


def test_a_cached_openai_input_at_the_models_length_is_counted_once(server):
    # 254 words of one token each + [CLS] + [SEP]: exactly the model's 256, so the hot path cannot tell
    # from the cached token count alone that it was not truncated and hands the request to the full path.
    text = " ".join(["hello"] * 254)
    body = {"input": text, "model": MODEL}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/embeddings", json=body).status_code == 200  # computed, now cached
        before = scrape(server.url)
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == 200
    after = scrape(server.url)
    assert delta(before, after, "surge_requests_total") == 1
    assert delta(before, after, "surge_inputs_total") == 1
    assert delta(before, after, "surge_cache_hits_total", tier="recent") == 1
    assert delta(before, after, "surge_request_latency_seconds_count") == 1


def test_a_request_retried_on_the_reloaded_copy_is_counted_once_and_not_failed(server):
    """A KServe infer request looks the model up, then waits for its body; a reload in between retires that
    copy, and the new copy answers it (200). One request for its client: one request on /metrics, no failure."""
    before = scrape(server.url)
    reply = infer_across_a_reload(server, MODEL, "late")
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    after = scrape(server.url)
    assert delta(before, after, "surge_requests_total") == 1
    assert sum(v for (n, _), v in after.items() if n == "surge_request_failures_total") == \
        sum(v for (n, _), v in before.items() if n == "surge_request_failures_total")
    assert delta(before, after, "surge_request_latency_seconds_count") == 1


def test_an_openai_input_longer_than_the_model_is_a_failure_not_a_success(server):
    """Refused with 400 after the runtime computed it (truncated, so cache keys stay one): /metrics and the
    KServe statistics count a failure under its code, not a success."""
    body = {"input": " ".join(["hello"] * 300), "model": MODEL}  # 302 tokens, the model takes 256

    def stats():
        (m,) = httpx.get(server.url + f"/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"]
        return m["inference_stats"]

    for _ in range(2):  # computed, then from the cache
        before, kserve_before = scrape(server.url), stats()
        r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 400 and "256" in r.text
        after, kserve_after = scrape(server.url), stats()
        assert delta(before, after, "surge_requests_total") == 1
        assert delta(before, after, "surge_request_failures_total", code="invalid_input") == 1
        assert kserve_after["fail"]["count"] - kserve_before["fail"]["count"] == 1
        assert kserve_after["success"]["count"] == kserve_before["success"]["count"]



def gauges(url: str) -> dict[str, float]:
    """surge_cache_bytes / surge_cache_entries of MODEL, by tier."""
    got = scrape(url)
    return {f"{n}:{t}": got.get((n, (("tier", t),)), 0.0) for n in ("surge_cache_bytes", "surge_cache_entries")
            for t in ("recent", "pinned")}


def test_a_reload_sets_the_cache_gauges_to_the_new_caches_state():
    """A same-version reload serves from a new, empty cache: surge_cache_bytes / surge_cache_entries say so
    at once, for every tier, not the old cache's values until the new one's first write to that tier."""
    with ServerProcess("--max-queue-delay-ms", "1", "--threads", "1", "--cache-pinned", "4") as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for _ in range(3):  # seen twice, then again: the learned hot set pins it
                assert c.post("/v1/embeddings", json={"input": ["a popular query"], "model": MODEL}).status_code == 200
            assert c.post("/v1/embeddings", json={"input": [f"once {i}" for i in range(4)],
                                                  "model": MODEL}).status_code == 200
            filled = gauges(srv.url)
            assert filled["surge_cache_entries:pinned"] == 1 and filled["surge_cache_bytes:pinned"] > 0
            assert filled["surge_cache_entries:recent"] >= 4
            assert c.post(f"/models/{MODEL}/reload").status_code == 200
            after = gauges(srv.url)
    # the new build's warm-up embeds one text through the whole path: at most that entry, in the recent tier
    assert after["surge_cache_entries:pinned"] == 0 and after["surge_cache_bytes:pinned"] == 0
    assert after["surge_cache_entries:recent"] <= 1
    assert after["surge_cache_bytes:recent"] < filled["surge_cache_bytes:recent"] / 2
