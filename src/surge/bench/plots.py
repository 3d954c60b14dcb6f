"""PNG plots of benchmark runs (matplotlib, Agg backend): latency CDF, latency
against throughput across a sweep, and cache hit ratio against cache size."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Iterable

import numpy as np

from surge.bench.loadgen import RunResult
from surge.bench.report import summarize


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(runs: dict[str, list[RunResult]], path: str | Path, title: str = "latency CDF") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]
    for i, (name, rs) in enumerate(runs.items()):
        for j, r in enumerate(rs):  # one colour per target, one line style per load level
            lat = np.sort(r.latency[r.ok]) * 1000
            if lat.size == 0:
                continue
            y = np.arange(1, lat.size + 1) / lat.size
            ax.plot(lat, y, color=f"C{i}", ls=styles[j % len(styles)], label=f"{name} · {r.spec.label()}")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    for q in (0.5, 0.99):
        ax.axhline(q, color="grey", lw=0.5, ls=":")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def latency_vs_throughput(runs: dict[str, list[RunResult]], path: str | Path,
                          title: str = "latency against throughput") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, rs) in enumerate(runs.items()):
        ss = [summarize(r) for r in rs]
        x = [s["throughput_rps"] for s in ss]
        color = f"C{i}"
        ax.plot(x, [s["latency_ms"]["p50"] or np.nan for s in ss], "o-", color=color, label=f"{name} p50")
        ax.plot(x, [s["latency_ms"]["p99"] or np.nan for s in ss], "s--", color=color, label=f"{name} p99")
        for s, xi in zip(ss, x):
            ax.annotate(s["label"], (xi, s["latency_ms"]["p99"] or np.nan), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (successful requests/s)")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def lru_hit_ratios(stream: Iterable[str], sizes: list[int], warmup: int = 0) -> list[float]:
    """Hit ratio of an LRU cache of each size (in entries) over a query stream (after `warmup` requests)."""
    seq = list(stream)
    out = []
    for size in sizes:
        cache: OrderedDict[str, None] = OrderedDict()
        hits = total = 0
        for i, q in enumerate(seq):
            hit = q in cache
            if hit:
                cache.move_to_end(q)
            elif size > 0:
                cache[q] = None
                if len(cache) > size:
                    cache.popitem(last=False)
            if i >= warmup:
                total += 1
                hits += hit
        out.append(hits / total if total else 0.0)
    return out


def cache_hit_vs_size(sizes: list[int], ratios: list[float], path: str | Path, measured: dict | None = None,
                      title: str = "cache hit ratio against cache size", bytes_per_entry: int | None = None,
                      pinned: list[float] | None = None) -> Path:
    """Simulated LRU hit ratio by size; `pinned` the ideal static top-K tier's (the popularity mass of
    the K hottest queries); `measured` adds server-reported ratios: name -> ratio (a horizontal line)
    or (ratio, entries) (a point at the size the server reported)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(sizes, ratios, "o-", label="LRU on this workload (simulated)")
    if pinned is not None:
        ax.plot(sizes, pinned, "^-", label="pinned top-K hot set (ideal, exact)")
    for i, (name, point) in enumerate((measured or {}).items()):
        ratio, entries = point if isinstance(point, tuple) else (point, None)
        if entries:  # the server said how many entries it held: a point at that size
            ax.plot([entries], [ratio], "*", ms=14, color=f"C{i + 2}",
                    label=f"{name}: measured {ratio:.0%} at {entries} entries")
        else:
            ax.axhline(ratio, color=f"C{i + 2}", ls="--", label=f"{name}: measured {ratio:.0%}")
    ax.set_xscale("log")
    xlabel = "cache size (entries)"
    if bytes_per_entry:
        xlabel += f"; x {bytes_per_entry} B per entry"
    ax.set_xlabel(xlabel)
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def sample_cdfs(panels: dict[str, dict[str, list[float]]], path: str | Path, title: str = "") -> Path:
    """One panel per entry of `panels` (its title -> {series name: samples in ms}), each series the CDF
    of its samples on a log axis, medians and p99 marked by grey lines; empty series are left out."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items()):
        for i, (name, values) in enumerate(series.items()):
            v = np.sort(np.asarray(values, dtype=float))
            if v.size == 0:
                continue
            ax.plot(v, np.arange(1, v.size + 1) / v.size, color=f"C{i}", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction")
        ax.set_title(panel)
        for q in (0.5, 0.99):
            ax.axhline(q, color="grey", lw=0.5, ls=":")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_all(runs: dict[str, list[RunResult]], out_dir: str | Path, prefix: str = "bench",
              workload=None, measured_hits: dict | None = None, n_sim: int = 50_000) -> list[Path]:
    """The three standard plots; the cache plot needs the workload (to simulate) or measured ratios."""
    out_dir = Path(out_dir)
    if measured_hits is None:
        measured_hits = measured_cache_points(runs)
    paths = [latency_cdf(runs, out_dir / f"{prefix}_latency_cdf.png"),
             latency_vs_throughput(runs, out_dir / f"{prefix}_latency_vs_throughput.png")]
    if workload is not None and workload.weights is not None:
        n = len(workload.queries)
        sizes = sorted({10, 50, 100, 250, 500, 1000, 2000, 4000, n})
        ratios = lru_hit_ratios(_take(workload.stream(seed=workload.seed + 1000), n_sim), sizes, warmup=n_sim // 5)
        mass = np.cumsum(np.sort(workload.weights)[::-1])
        pinned = [float(mass[min(k, n) - 1]) for k in sizes]
        paths.append(cache_hit_vs_size(sizes, ratios, out_dir / f"{prefix}_cache_hit_vs_size.png", measured_hits,
                                       pinned=pinned,
                                       title=f"cache hit ratio against cache size (Zipf s={workload.zipf_s:.2f}, "
                                             f"{n} queries)"))
    return paths


def measured_cache_points(runs: dict[str, list[RunResult]]) -> dict:
    """Server-reported cache hit ratios of each run, with the entry count when the server gave one."""
    out = {}
    for name, rs in runs.items():
        for r in rs:
            s = summarize(r)
            if s.get("cache_hit_ratio") is not None:
                out[f"{name} · {s['label']}"] = (s["cache_hit_ratio"], s.get("cache_entries"))
    return out


def _take(it, n):
    return [next(it) for _ in range(n)]
