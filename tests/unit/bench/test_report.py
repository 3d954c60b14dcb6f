"""Percentiles and summaries against numpy, on known samples."""

from __future__ import annotations

import numpy as np
import pytest

from surge.bench.loadgen import LoadSpec, RunResult
from surge.bench.report import percentiles, summarize


def _run(latency, ok, kinds, window=2.0, mode="closed"):
    spec = LoadSpec(mode=mode, concurrency=4, rate=10.0 if mode == "open" else 0.0)
    n = len(latency)
    sched = np.linspace(0, window * 0.9, n)
    return RunResult(spec, "t", sched, sched + 0.001, np.asarray(latency), np.asarray(ok), kinds, window, 1, 3)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 12345])
def test_percentiles_match_numpy(n):
    rng = np.random.default_rng(n)
    lat = rng.lognormal(-4, 1.0, size=n)
    got = percentiles(lat)
    want = np.percentile(lat * 1000, [50, 90, 99, 99.9])
    assert [got["p50"], got["p90"], got["p99"], got["p99.9"]] == pytest.approx(list(want), rel=1e-12)


def test_percentiles_known_values():
    # 1..1000 ms: numpy's linear interpolation gives p50 = 500.5, p99 = 990.01, p99.9 = 999.001
    got = percentiles(np.arange(1, 1001) / 1000)
    assert got["p50"] == pytest.approx(500.5)
    assert got["p90"] == pytest.approx(900.1)
    assert got["p99"] == pytest.approx(990.01)
    assert got["p99.9"] == pytest.approx(999.001)
    assert percentiles(np.array([]))["p50"] is None


def test_summary_counts_errors_and_excludes_them_from_latency():
    rng = np.random.default_rng(1)
    lat = rng.uniform(0.01, 0.02, size=100)
    ok = np.ones(100, bool)
    kinds = [None] * 100
    for i in range(0, 100, 10):  # 10 failures with huge latencies
        ok[i] = False
        lat[i] = 50.0
        kinds[i] = "http_500" if i % 20 else "timeout"
    s = summarize(_run(lat, ok, kinds, window=2.5))
    assert s["requests"] == 100 and s["ok"] == 90 and s["error_count"] == 10
    assert s["errors"] == {"http_500": 5, "timeout": 5}
    assert s["throughput_rps"] == pytest.approx(90 / 2.5)
    assert s["latency_ms"]["p99"] == pytest.approx(np.percentile(lat[ok] * 1000, 99))
    assert s["latency_ms"]["max"] < 20.0001
    assert s["warmup_requests"] == 3


def test_summary_of_a_run_where_everything_failed():
    s = summarize(_run([0.001] * 5, [False] * 5, ["connect"] * 5))
    assert s["ok"] == 0 and s["throughput_rps"] == 0.0 and s["errors"] == {"connect": 5}
    assert s["latency_ms"]["p50"] is None


def _columns(markdown: str) -> list[dict[str, str]]:
    head, _, *rows = markdown.strip().splitlines()
    names = [c.strip() for c in head.strip("|").split("|")]
    return [dict(zip(names, (c.strip() for c in row.strip("|").split("|")))) for row in rows]


def test_comparison_ratio_headers_say_their_direction():
    # The candidate is twice as fast with half the p99: each ratio column names which side is over which and
    # which way is better, and its value follows that header (not the other way round).
    from surge.bench.report import comparison_markdown

    rng = np.random.default_rng(3)
    base_lat = rng.uniform(0.010, 0.040, size=200)
    base = _run(base_lat, np.ones(200, bool), [None] * 200, window=4.0)
    cand = _run(base_lat / 2, np.ones(400, bool)[:200], [None] * 200, window=2.0)
    [row] = _columns(comparison_markdown([base], [cand], "base", "surge"))
    ratio_cols = [c for c in row if c != "load" and not c.startswith(("base ", "surge ", "errors"))]
    assert len(ratio_cols) == 2, list(row)
    for col in ratio_cols:
        assert "surge/base" in col, col
    [tput] = [c for c in ratio_cols if "req/s" in c]
    [p99] = [c for c in ratio_cols if "p99" in c]
    assert "higher is better" in tput and "lower is better" in p99
    sb, sc = summarize(base), summarize(cand)
    assert float(row[tput].rstrip("x")) == pytest.approx(sc["throughput_rps"] / sb["throughput_rps"], abs=0.01)
    assert float(row[p99].rstrip("x")) == pytest.approx(sc["latency_ms"]["p99"] / sb["latency_ms"]["p99"], abs=0.01)
