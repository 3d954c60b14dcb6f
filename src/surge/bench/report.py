"""Summaries of runs: percentiles, throughput, errors by kind, server metrics; JSON and tables."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np

from surge.bench.loadgen import RunResult
from surge.bench.timing import cpu_name

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def percentiles(latencies_s: np.ndarray, qs=PERCENTILES) -> dict[str, float | None]:
    """Latency percentiles in milliseconds (numpy's default linear interpolation); None when empty."""
    lat = np.asarray(latencies_s, dtype=np.float64)
    if lat.size == 0:
        return {f"p{q:g}": None for q in qs}
    vals = np.percentile(lat * 1000.0, qs)
    return {f"p{q:g}": float(v) for q, v in zip(qs, vals)}


def summarize(r: RunResult) -> dict:
    """One run as a flat, JSON-ready dict. Latency percentiles are over successful requests (failures are
    counted by kind in `errors`). Throughput: successful completions in the measurement window over its
    length (bench/loadgen.py says why; a run bounded by its request count: measured successes over the
    time to the last completion)."""
    ok_lat = r.latency[r.ok]
    n_ok = int(r.ok.sum())
    window = r.window_s if r.window_s > 0 else float("nan")
    done = n_ok if r.completed_in_window is None else r.completed_in_window
    out = {
        "target": r.target,
        "mode": r.spec.mode,
        "level": r.spec.level,
        "label": r.spec.label(),
        "concurrency": r.spec.concurrency,
        "offered_rate": r.spec.rate if r.spec.mode == "open" else None,
        "requests": r.count,
        "ok": n_ok,
        "errors": r.errors,
        "error_examples": dict(r.error_examples),
        "interrupted": r.interrupted,
        "error_count": r.count - n_ok,
        "warmup_requests": r.warmup_requests,
        "window_s": r.window_s,
        "completed_in_window": done,
        "throughput_rps": done / window if done else 0.0,
        "inputs_per_s": done * r.inputs_per_request / window if done else 0.0,
        "sent_rate": r.count / (float(r.scheduled.max()) if r.count > 1 and r.scheduled.max() > 0 else window)
        if r.count else 0.0,
        "latency_ms": {**percentiles(ok_lat), "mean": float(ok_lat.mean() * 1000) if n_ok else None,
                       "max": float(ok_lat.max() * 1000) if n_ok else None},
        # Open loop only: how late the generator itself sent (its own health check).
        "send_lag_ms_p99": float(np.percentile((r.started - r.scheduled) * 1000, 99)) if r.count else None,
        # The generator's CPU (its whole process: an in-process target's engine too) a request sent, and in
        # cores over the run: on a shared machine, taken from the server under test.
        "generator_cpu_ms_per_request": r.generator_cpu_s * 1000 / (r.count + r.warmup_requests)
        if r.count + r.warmup_requests and r.generator_wall_s else None,
        "generator_cores": r.generator_cpu_s / r.generator_wall_s if r.generator_wall_s else None,
    }
    out.update(r.metrics)
    return out


def environment() -> dict:
    """Where and how the numbers were taken: date, machine, and the command line that produced them."""
    import os

    from surge.bench.timing import command_line

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
            "cpus": os.cpu_count(), "cpu": cpu_name(), "python": platform.python_version(),
            "command": command_line()}


def write_json(path: str | Path, runs: dict[str, list[RunResult]], extra: dict | None = None) -> Path:
    """{"environment", "runs": {target: [summary, ...]}, "latencies_ms": {...}, **extra}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"environment": environment(), **(extra or {}),
           "runs": {name: [summarize(r) for r in rs] for name, rs in runs.items()}}
    path.write_text(json.dumps(doc, indent=2, default=_jsonable))
    return path


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, set):
        return sorted(o)
    return str(o)


def _fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(runs: dict[str, list[RunResult]], title: str = "surge bench"):
    """A rich Table: one row per (target, level)."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("target", "load", "req/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "errors", "cache hit",
                "batch", "gen CPU ms/req"):
        text = col in ("target", "load", "errors")
        # A number squeezed by a narrow terminal wraps rather than losing digits to an ellipsis.
        t.add_column(col, justify="left" if text else "right", overflow="ellipsis" if text else "fold")
    for name, rs in runs.items():
        for r in rs:
            s = summarize(r)
            lat = s["latency_ms"]
            errs = ", ".join(f"{k}={v}" for k, v in s["errors"].items()) or "0"
            hit = s.get("cache_hit_ratio")
            t.add_row(name, s["label"], _fmt(s["throughput_rps"]), _fmt(lat["p50"]), _fmt(lat["p90"]),
                      _fmt(lat["p99"]), _fmt(lat["p99.9"]), errs, "-" if hit is None else f"{hit:.0%}",
                      _fmt(s.get("batch_size_mean")), _fmt(s["generator_cpu_ms_per_request"], 3))
    return t


def comparison_markdown(base: list[RunResult], cand: list[RunResult], base_name: str, cand_name: str) -> str:
    """A markdown table comparing two targets level by level (throughput ratio, p99 ratio)."""
    lines = [f"| load | {base_name} req/s | {cand_name} req/s | speed-up | {base_name} p50 ms | {cand_name} p50 ms "
             f"| {base_name} p99 ms | {cand_name} p99 ms | p99 ratio | errors ({base_name} / {cand_name}) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for b, c in zip(base, cand):
        sb, sc = summarize(b), summarize(c)
        speed = sc["throughput_rps"] / sb["throughput_rps"] if sb["throughput_rps"] else float("nan")
        p99b, p99c = sb["latency_ms"]["p99"], sc["latency_ms"]["p99"]
        ratio = p99c / p99b if p99b and p99c else float("nan")
        lines.append(f"| {sb['label']} | {sb['throughput_rps']:.1f} | {sc['throughput_rps']:.1f} | {speed:.2f}x "
                     f"| {_fmt(sb['latency_ms']['p50'])} | {_fmt(sc['latency_ms']['p50'])} "
                     f"| {_fmt(p99b)} | {_fmt(p99c)} | {ratio:.2f} | {sb['error_count']} / {sc['error_count']} |")
    return "\n".join(lines)
