"""Summaries of runs: percentiles, throughput, errors by kind, server metrics; JSON and tables."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np

from surge.bench.loadgen import RunResult
from surge.bench.targets import OVERLOAD_KINDS
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
    time to the last completion).

    Counts: `requests` (measured, scheduled) = `ok` + `error_count` (sent and failed: non-2xx, transport
    error, timeout, bad answer) + `dropped` (open loop: arrivals that found `max_inflight` in flight, not
    sent). `overload_count` is the part of `error_count` that was the server shedding load (429/503)."""
    ok_lat = r.latency[r.ok]
    n_ok = int(r.ok.sum())
    errors = r.errors
    dropped = r.dropped
    window = r.window_s if r.window_s > 0 else float("nan")
    done = n_ok if r.completed_in_window is None else r.completed_in_window
    out = {
        "target": r.target,
        "mode": r.spec.mode,
        "level": r.spec.level,
        "label": r.spec.label(),
        "concurrency": r.spec.concurrency,
        "offered_rate": r.spec.rate if r.spec.mode == "open" else None,
        "max_inflight": r.spec.max_inflight if r.spec.mode != "closed" else None,
        "requests": r.count,
        "ok": n_ok,
        "errors": errors,
        "error_examples": dict(r.error_examples),
        "error_messages": {k: list(v) for k, v in r.error_messages.items()},
        "interrupted": r.interrupted,
        "error_count": sum(errors.values()),
        "overload_count": sum(n for k, n in errors.items() if k in OVERLOAD_KINDS),
        "dropped": dropped,
        "warmup_requests": r.warmup_requests,
        "window_s": r.window_s,
        "completed_in_window": done,
        "throughput_rps": done / window if done else 0.0,
        "inputs_per_s": done * r.inputs_per_request / window if done else 0.0,
        "sent_rate": (r.count - dropped) / (float(r.scheduled.max()) if r.count > 1 and r.scheduled.max() > 0
                                            else window) if r.count else 0.0,
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
    for col in ("target", "load", "req/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "errors", "overload",
                "dropped", "cache hit", "batch", "gen CPU ms/req"):
        text = col in ("target", "load", "errors", "overload")
        # A number squeezed by a narrow terminal wraps rather than losing digits to an ellipsis.
        t.add_column(col, justify="left" if text else "right", overflow="ellipsis" if text else "fold")
    for name, rs in runs.items():
        for r in rs:
            s = summarize(r)
            lat = s["latency_ms"]
            # Overload answers (429/503) apart from the other failures: an open loop past capacity should see
            # them, a broken server should not.
            errs = ", ".join(f"{k}={v}" for k, v in s["errors"].items() if k not in OVERLOAD_KINDS) or "0"
            over = ", ".join(f"{k}={v}" for k, v in s["errors"].items() if k in OVERLOAD_KINDS) or "0"
            hit = s.get("cache_hit_ratio")
            t.add_row(name, s["label"], _fmt(s["throughput_rps"]), _fmt(lat["p50"]), _fmt(lat["p90"]),
                      _fmt(lat["p99"]), _fmt(lat["p99.9"]), errs, over, str(s["dropped"]),
                      "-" if hit is None else f"{hit:.0%}",
                      _fmt(s.get("batch_size_mean")), _fmt(s["generator_cpu_ms_per_request"], 3))
    return t


def comparison_markdown(base: list[RunResult], cand: list[RunResult], base_name: str, cand_name: str) -> str:
    """A markdown table comparing two targets level by level. Both ratios are candidate over baseline, and
    their headers say so and which way is better (higher for throughput, lower for p99)."""
    ratio = f"{cand_name}/{base_name}"
    lines = [f"| load | {base_name} req/s | {cand_name} req/s | req/s {ratio} (higher is better) "
             f"| {base_name} p50 ms | {cand_name} p50 ms | {base_name} p99 ms | {cand_name} p99 ms "
             f"| p99 {ratio} (lower is better) | errors ({base_name} / {cand_name}) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for b, c in zip(base, cand):
        sb, sc = summarize(b), summarize(c)
        speed = sc["throughput_rps"] / sb["throughput_rps"] if sb["throughput_rps"] else float("nan")
        p99b, p99c = sb["latency_ms"]["p99"], sc["latency_ms"]["p99"]
        p99_ratio = p99c / p99b if p99b and p99c else float("nan")
        lines.append(f"| {sb['label']} | {sb['throughput_rps']:.1f} | {sc['throughput_rps']:.1f} | {speed:.2f}x "
                     f"| {_fmt(sb['latency_ms']['p50'])} | {_fmt(sc['latency_ms']['p50'])} "
                     f"| {_fmt(p99b)} | {_fmt(p99c)} | {p99_ratio:.2f}x | {sb['error_count']} / {sc['error_count']} |")
    return "\n".join(lines)


def failed_fraction(s: dict) -> float:
    """The part of a level's measured requests that did not succeed: failed (overload answers included) or
    dropped. `s` is a `summarize` dict; 0 when nothing was measured."""
    return (s["error_count"] + s["dropped"]) / s["requests"] if s["requests"] else 0.0


def failure_report(runs: dict[str, list[RunResult]]) -> list[str]:
    """Plain lines for every level that had failures or drops: the counts (overload apart) and, per kind,
    its first distinct messages. Empty when every request succeeded."""
    lines: list[str] = []
    for name, rs in runs.items():
        for r in rs:
            s = summarize(r)
            if not s["error_count"] and not s["dropped"]:
                continue
            parts = []
            if s["error_count"]:
                parts.append(f"{s['error_count']} of {s['requests']} measured requests failed "
                             f"({s['overload_count']} overload (429/503), "
                             f"{s['error_count'] - s['overload_count']} other)")
            if s["dropped"]:
                parts.append(f"{s['dropped']} of {s['requests']} arrivals dropped (not sent: "
                             f"{s['max_inflight']} already in flight, the -c cap)")
            lines.append(f"{name} · {s['label']}: " + "; ".join(parts))
            for kind, n in s["errors"].items():
                messages = s["error_messages"].get(kind) or [s["error_examples"].get(kind, "")]
                lines.append(f"  {kind} x{n}: " + " | ".join(m.removeprefix(f"{kind}: ") for m in messages))
    return lines
