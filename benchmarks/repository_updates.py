"""What a zero-downtime version update costs the clients that keep sending.

Starts one `surge serve --model-repository` with model `enc` version 1, runs C
concurrent clients against POST /embed, and measures three phases in one run:
steady state on version 1 (the baseline), the update windows (version N+1 is
loaded, warmed up, switched to, version N drained and freed; repeated U times),
and steady state after. Prints a table (requests, failures, median and p99
latency, ratios to the baseline) and writes a PNG of latency over time with the
updates marked.

    python benchmarks/repository_updates.py [--clients 32] [--updates 4] [--steady-s 5] [--out out/bench]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL_YAML = "engine: {threads: %d, warmup_shapes: [[1, 16], [8, 32]]}\n"


def write_version(root: Path, version: int, threads: int) -> None:
    path = root / "enc" / str(version) / "model.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(MODEL_YAML % threads)
    tmp.replace(path)


async def scenario(url: str, root: Path, args, texts: list[str]):
    import httpx

    log: list[tuple[float, float, int, str]] = []  # (sent, latency, status, version)
    windows: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def client(seed: int, http) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            batch = rng.sample(texts, 2)
            sent = time.monotonic()
            try:
                r = await http.post("/embed", json={"inputs": batch, "model": "enc"})
                log.append((sent, time.monotonic() - sent, r.status_code, r.headers.get("x-surge-model-version", "")))
            except httpx.HTTPError:
                log.append((sent, time.monotonic() - sent, -1, ""))

    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        tasks = [asyncio.create_task(client(i, http)) for i in range(args.clients)]
        t0 = time.monotonic()
        await asyncio.sleep(args.steady_s)
        for u in range(args.updates):
            write_version(root, u + 2, args.threads)
            start = time.monotonic()
            r = await http.post("/models/enc/load")
            assert r.status_code == 200, r.text
            windows.append((start, time.monotonic()))
            await asyncio.sleep(1.0)
        await asyncio.sleep(args.steady_s)
        stop.set()
        await asyncio.gather(*tasks)
    return t0, log, windows


def summarize(t0, log, windows, steady_s):
    def phase(entry):
        sent = entry[0]
        if sent < t0 + steady_s:
            return "steady (before)"
        if any(a - 0.05 <= sent <= b + 0.3 for a, b in windows):
            return "during updates"
        if sent > windows[-1][1] + 1.0:
            return "steady (after)"
        return "between updates"

    phases: dict[str, list] = {}
    for e in log:
        phases.setdefault(phase(e), []).append(e)
    base = np.array([e[1] for e in phases["steady (before)"] if e[2] == 200])
    rows = []
    for name in ("steady (before)", "during updates", "between updates", "steady (after)"):
        entries = phases.get(name, [])
        lat = np.array([e[1] for e in entries if e[2] == 200]) * 1000
        if not len(lat):
            continue
        rows.append((name, len(entries), sum(e[2] != 200 for e in entries), np.median(lat), np.percentile(lat, 99),
                     np.median(lat) / (np.median(base) * 1000), np.percentile(lat, 99) / (np.percentile(base, 99) * 1000)))
    return rows


def plot(t0, log, windows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    versions = sorted({e[3] for e in log if e[3]}, key=int)
    for v in versions:
        pts = [(e[0] - t0, e[1] * 1000) for e in log if e[3] == v]
        ax.scatter(*zip(*pts), s=3, label=f"version {v}")
    for a, b in windows:
        ax.axvspan(a - t0, b - t0, color="grey", alpha=0.25)
    ax.set_xlabel("time (s); grey: load + warm-up + switch + drain of the next version")
    ax.set_ylabel("request latency (ms)")
    ax.set_yscale("log")
    ax.legend(markerscale=4, fontsize=8)
    ax.set_title("POST /embed latency while model versions are replaced")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--steady-s", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads of each version")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "bench")
    args = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    from surge.data import load_sentences
    from tests.server_process import ServerProcess

    console = Console()
    texts = load_sentences()[:200]
    root = Path(tempfile.mkdtemp(prefix="surge-bench-repo-"))
    write_version(root, 1, args.threads)
    with console.status("starting surge serve --model-repository"):
        srv = ServerProcess("--model-repository", str(root)).start()
    try:
        with console.status(f"{args.clients} clients, {args.updates} version updates"):
            t0, log, windows = asyncio.run(scenario(srv.url, root, args, texts))
    finally:
        srv.stop()
    rows = summarize(t0, log, windows, args.steady_s)
    table = Table(title=f"POST /embed with {args.clients} clients while enc is updated {args.updates} times "
                        f"({platform.node()}, {platform.processor() or platform.machine()})")
    for col in ("phase", "requests", "failed", "median ms", "p99 ms", "median / baseline", "p99 / baseline"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for name, n, failed, med, p99, rmed, rp99 in rows:
        table.add_row(name, str(n), str(failed), f"{med:.1f}", f"{p99:.1f}", f"{rmed:.2f}", f"{rp99:.2f}")
    console.print(table)
    update_s = [b - a for a, b in windows]
    console.print(f"update (load + warm-up + switch + drain) took median {np.median(update_s):.2f} s; "
                  f"versions answering: {sorted({e[3] for e in log if e[3]}, key=int)}")
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "repository_updates.png"
    plot(t0, log, windows, png)
    console.print(f"plot: {png}")


if __name__ == "__main__":
    main()
