"""Merging replica metrics into the ingress's /metrics (distributed/metrics_hub.py, no Ray needed)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from surge.distributed.metrics_hub import MetricsHub, merge


def _process(requests: int, latencies: np.ndarray) -> str:
    """One replica process's exposition text: a counter and a histogram with real observations."""
    reg = CollectorRegistry()
    c = Counter("surge_requests", "Requests received.", ("model", "version"), registry=reg)
    h = Histogram("surge_request_latency_seconds", "Latency.", ("model", "version"), registry=reg,
                  buckets=(0.001, 0.01, 0.1, 1.0))
    c.labels("m", "1").inc(requests)
    for x in latencies:
        h.labels("m", "1").observe(float(x))
    return generate_latest(reg).decode()


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_merge_labels_every_replica_and_keeps_families_whole():
    rng = np.random.default_rng()
    counts = rng.integers(1, 1000, size=3)
    lats = [rng.exponential(0.02, size=int(rng.integers(5, 50))) for _ in range(3)]
    own = CollectorRegistry()
    Counter("surge_ingress_things", "Ingress-only.", registry=own).inc(7)
    sources = [(f"r{i}:{100 + i}", _process(int(counts[i]), lats[i])) for i in range(3)]
    merged = merge(generate_latest(own), sources).decode()

    names = [fam.name for fam in text_string_to_metric_families(merged)]
    assert len(names) == len(set(names)), "one family per name, not one per replica"
    got = _samples(merged)
    assert got[("surge_ingress_things_total", ())] == 7  # the ingress's own samples, unlabelled
    for i, (replica, text) in enumerate(sources):
        for (name, labels), value in _samples(text).items():
            assert got[(name, tuple(sorted(labels + (("replica", replica),))))] == value
        key = (("model", "m"), ("replica", replica), ("version", "1"))
        assert got[("surge_requests_total", key)] == counts[i]
        assert got[("surge_request_latency_seconds_count", key)] == len(lats[i])
        assert np.isclose(got[("surge_request_latency_seconds_sum", key)], lats[i].sum())
    total = sum(v for (n, _), v in got.items() if n == "surge_requests_total")
    assert total == counts.sum()


def test_hub_keeps_the_latest_text_and_drops_silent_replicas():
    import time

    h = MetricsHub()
    h.put("a:1", "old")
    h.put("b:2", "b text")
    h.put("a:1", "new")
    assert h.collect(60.0) == [("a:1", "new"), ("b:2", "b text")]
    time.sleep(0.05)
    h.put("b:2", "b again")
    assert h.collect(0.03) == [("b:2", "b again")], "a:1 was silent longer than max_age_s"
