"""Reading cache/batch statistics from Prometheus text; PNG plots are written and valid."""

from __future__ import annotations

import numpy as np
import pytest

from surge.bench import metrics as prom


def _exposition(hits: int, misses: int, batches: list[int]) -> str:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    h = Counter("surge_cache_hits", "hits", ["model"], registry=reg)
    m = Counter("surge_cache_misses", "misses", ["model"], registry=reg)
    b = Histogram("surge_batch_size", "inputs per batch", ["model"], buckets=(1, 2, 4, 8, 16, 32, 64),
                  registry=reg)
    Counter("surge_requests", "unrelated", registry=reg).inc(99)
    e = Gauge("surge_cache_entries", "entries", ["model", "tier"], registry=reg)
    e.labels("a", "pinned").set(hits)
    e.labels("a", "recent").set(misses)
    h.labels("a").inc(hits)
    m.labels("a").inc(misses)
    for x in batches:
        b.labels("a").observe(x)
    return generate_latest(reg).decode()


def test_cache_and_batch_deltas_from_prometheus_text():
    before = prom.parse(_exposition(10, 30, [1, 1, 2]))
    after = prom.parse(_exposition(10 + 70, 30 + 30, [1, 1, 2] + [8] * 10 + [16] * 5))
    d = prom.delta(before, after)
    assert d["cache_hits"] == 70 and d["cache_misses"] == 30
    assert d["cache_hit_ratio"] == pytest.approx(0.7)
    assert d["cache_entries"] == 80 + 60  # the gauge now (both tiers), not a delta
    assert d["batches"] == 15
    assert d["batch_size_mean"] == pytest.approx((8 * 10 + 16 * 5) / 15)
    assert d["batch_size_buckets"]["8.0"] == 10 and d["batch_size_buckets"]["16.0"] == 15


def test_label_style_and_triton_names():
    text = """# TYPE cache_lookups_total counter
cache_lookups_total{result="hit"} 30
cache_lookups_total{result="miss"} 10
# TYPE nv_inference_count counter
nv_inference_count{model="m"} 120
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="m"} 10
"""
    d = prom.delta(None, prom.parse(text))
    assert d["cache_hit_ratio"] == pytest.approx(0.75)
    assert d["batch_size_mean"] == pytest.approx(12.0)


def test_no_metrics_means_no_columns():
    assert prom.delta(None, None) == {}
    assert prom.delta(None, prom.parse("# TYPE x counter\nx_total 3\n")) == {}


def test_lru_simulation_matches_a_hand_count():
    from surge.bench.plots import lru_hit_ratios

    seq = ["a", "b", "a", "c", "b", "a", "d", "a"]
    # size 1: only immediate repeats hit (none); size 2: a b a(hit) c b(miss: evicted) a(miss) d a(hit)
    assert lru_hit_ratios(seq, [0, 1, 2, 4]) == pytest.approx([0, 0, 2 / 8, 4 / 8])


def test_plots_are_valid_pngs(tmp_path):
    from PIL import Image

    from surge.bench.loadgen import LoadSpec, RunResult
    from surge.bench.plots import write_all
    from surge.bench.workloads import make_workload

    rng = np.random.default_rng(0)

    def fake_run(c):  # synthetic samples: the plots, not the load, are under test here
        lat = rng.lognormal(np.log(0.01 * c), 0.5, size=500)
        sched = np.sort(rng.uniform(0, 5, 500))
        return RunResult(LoadSpec(concurrency=c), "x", sched, sched, lat, np.ones(500, bool), [None] * 500, 5.0, 1, 0)

    runs = {"base": [fake_run(c) for c in (1, 4, 16)], "surge": [fake_run(c) for c in (1, 4, 16)]}
    paths = write_all(runs, tmp_path, workload=make_workload(2000, seed=0),
                      measured_hits={"surge · 16 clients": (0.4, 900), "other": 0.2},
                      n_sim=5000)
    assert sorted(p.name for p in paths) == ["bench_cache_hit_vs_size.png", "bench_latency_cdf.png",
                                             "bench_latency_vs_throughput.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            assert im.size[0] > 300 and im.size[1] > 200


def test_sample_cdfs_one_panel_each_with_a_cdf_per_nonempty_series(tmp_path, monkeypatch):
    from PIL import Image

    from surge.bench import plots

    rng = np.random.default_rng(3)
    a, b = rng.lognormal(2, 0.5, 300), rng.lognormal(3, 0.2, 50)
    figs = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), save(fig, path))[1])
    out = plots.sample_cdfs({"ttft": {"x": list(a), "y": list(b), "none": []}, "gaps": {"x": list(b)}},
                            tmp_path / "cdf.png", "t")
    with Image.open(out) as im:
        im.verify()
    (fig,) = figs
    ttft, gaps = fig.axes[:2]
    assert ttft.get_title() == "ttft" and gaps.get_title() == "gaps"
    curves = [ln for ln in ttft.get_lines() if ln.get_label() in ("x", "y", "none")]
    assert [ln.get_label() for ln in curves] == ["x", "y"]  # the empty series left out
    x, y = curves[0].get_data()
    assert np.array_equal(x, np.sort(a)) and np.allclose(y, np.arange(1, 301) / 300)
