"""Serving-runtime benchmark: batching on/off, cache hit ratios, cache-hit throughput.

    PYTHONPATH=src python benchmarks/runtime_serving.py [--seconds 15] [--zipf-exponent 0.85]
    PYTHONPATH=src python benchmarks/runtime_serving.py --parts batching --engine torch --precision bf16

One run, three parts, each against a baseline measured in the same run:
1. 64 closed-loop clients, short real queries (5-20 tokens), cache off:
   `surge serve` with batching on vs --no-batching (max batch 1).
2. A Zipf query stream: hit ratio of a pinned top-500 tier (seeded from a query
   log: the first half of the stream) and of recent tiers (LRU, TinyLFU) of
   several sizes, measured on the second half; table + PNG plot.
3. Cache-hit throughput through HTTP: closed-loop clients on cached queries.

Everything uses real components: real server processes, the bundled model, a
keep-alive HTTP/1.1 client (tests/http_load.py), the runtime's ResultCache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.http_load import closed_loop, encode_post  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

console = Console()


# ---- workloads ------------------------------------------------------------------
def short_queries(n: int, seed: int = 0) -> list[str]:
    """Real-sentence prefixes of 5-20 tokens (with special tokens)."""
    from surge.data import load_sentences
    from surge.models import bundled_model_dir, load_model_spec
    from surge.runtime.tokenize import Tokenizer

    spec = load_model_spec(bundled_model_dir())
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size)
    rng = random.Random(seed)
    sents = load_sentences()
    out = []
    while len(out) < n:
        words = rng.choice(sents).split()
        q = " ".join(words[: rng.randint(2, min(16, len(words)))])
        if 5 <= tok.count([q])[0] <= 20:
            out.append(q)
    return out


def zipf_stream(n_requests: int, universe: int, exponent: float, seed: int = 0) -> np.ndarray:
    """Query ranks (0 = hottest) drawn from a Zipf law truncated to `universe` items."""
    ranks = np.arange(1, universe + 1, dtype=np.float64)
    p = ranks ** -exponent
    p /= p.sum()
    return np.random.default_rng(seed).choice(universe, size=n_requests, p=p)


def top_share(universe: int, exponent: float, k: int = 500) -> float:
    w = np.arange(1, universe + 1, dtype=np.float64) ** -exponent
    return float(w[:k].sum() / w.sum())


# ---- part 1: batching ---------------------------------------------------------------
def run_load(url: str, queries: list[str], clients: int, seconds: float, warmup: float = 2.0):
    import uvloop

    wire = [encode_post("127.0.0.1", "/embed", {"inputs": [q]}) for q in queries]
    uvloop.run(closed_loop(url, wire, clients, duration=warmup))
    return uvloop.run(closed_loop(url, wire, clients, duration=seconds))


def bench_batching(args) -> list[dict]:
    """Both servers up at once; measured in alternating rounds (off, on, off,
    on...) so that drifting background load hits both alike. Throughput is
    the median over rounds, latency percentiles pool every round's requests."""
    import uvloop

    queries = short_queries(2000)
    modes = (("batching off (max batch 1)", ["--no-batching"]),
             ("batching on", ["--max-batch-size", str(args.max_batch), "--max-queue-delay-ms", str(args.delay_ms)]))
    servers = [ServerProcess("--cache-bytes", "0", "--threads", str(args.threads), *engine_flags(args), *flags)
               for _, flags in modes]
    wire = [encode_post("127.0.0.1", "/embed", {"inputs": [q]}) for q in queries]
    rps: list[list[float]] = [[], []]
    lat: list[list[float]] = [[], []]
    errors = [0, 0]
    try:
        with console.status("[bold]batching: starting servers[/]") as st:
            for srv in servers:
                srv.start()
            for k, srv in enumerate(servers):
                uvloop.run(closed_loop(srv.url, wire, args.clients, duration=2.0))  # warm-up
            for rnd in range(args.rounds):
                for k, srv in enumerate(servers):
                    st.update(f"[bold]batching[/]: round {rnd + 1}/{args.rounds}, {modes[k][0]}")
                    r = uvloop.run(closed_loop(srv.url, wire, args.clients, duration=args.seconds / args.rounds))
                    rps[k].append(r.throughput)
                    lat[k] += r.latencies
                    errors[k] += sum(v for c, v in r.statuses.items() if c != 200)
            sizes = [_batch_sizes(srv.url) for srv in servers]
    finally:
        for srv in servers:
            srv.stop()
    rows = []
    for k, (label, _) in enumerate(modes):
        pooled = sorted(lat[k])
        rows.append({"mode": label, "rps": float(np.median(rps[k])), "rps_rounds": rps[k],
                     "p50_ms": pooled[len(pooled) // 2] * 1e3, "p99_ms": pooled[int(0.99 * len(pooled))] * 1e3,
                     **sizes[k], "errors": errors[k]})
    return rows


def engine_flags(args) -> list[str]:
    """`surge serve` flags for the engine under test (the default: ONNX Runtime FP32)."""
    return ["--engine", args.engine, "--device", "cpu", "--precision", args.precision,
            "--instances", str(args.instances)]


def _batch_sizes(url: str) -> dict:
    """Mean batch size and mean engine time per batch and per input, from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    v = {"surge_batch_size_sum": 0.0, "surge_batch_size_count": 0.0, "surge_compute_latency_seconds_sum": 0.0}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for smp in fam.samples:
            if smp.name in v:
                v[smp.name] += smp.value
    n, inputs = v["surge_batch_size_count"], v["surge_batch_size_sum"]
    nan = float("nan")
    return {"mean_batch": inputs / n if n else nan,
            "compute_ms_per_batch": v["surge_compute_latency_seconds_sum"] * 1e3 / n if n else nan,
            "compute_ms_per_input": v["surge_compute_latency_seconds_sum"] * 1e3 / inputs if inputs else nan}


# ---- part 2: hit ratios ---------------------------------------------------------------
def bench_hit_ratio(args, out_dir: Path) -> tuple[list[dict], Path]:
    from surge.config import CacheConfig
    from surge.runtime.cache import ResultCache, make_entry

    stream = zipf_stream(args.zipf_requests, args.zipf_universe, args.zipf_exponent)
    half = len(stream) // 2
    train, test = stream[:half], stream[half:]
    vec = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    entry_bytes = make_entry(((None, True, None), "q123456"), vec, 8).nbytes
    log = Path(tempfile.mkstemp(prefix="surge-querylog-", suffix=".txt")[1])
    log.write_text("".join(f"q{r}\n" for r in train))
    sizes = [s for s in (250, 1000, 4000, 16000, 64000) if s < args.zipf_universe]

    def measure(cfg: CacheConfig) -> float:
        cache = ResultCache(cfg)
        opts = (None, True, None)
        for phase in (train, test):  # warm on the first half, measure the second
            hits = 0
            for r in phase.tolist():
                k = (opts, f"q{r}")
                if cache.get(k) is None:
                    cache.put(k, vec, 8)
                else:
                    hits += 1
        return hits / len(test)

    rows = []
    configs = [("pinned top-500 only", 0, dict(pinned_top_k=500, query_log=log, learn_hot=False, max_bytes=0))]
    for n in sizes:
        b = n * entry_bytes
        configs += [(f"LRU {n}", n, dict(max_bytes=b, recent_policy="lru")),
                    (f"TinyLFU {n}", n, dict(max_bytes=b, recent_policy="tinylfu")),
                    (f"pinned 500 + TinyLFU {n}", n, dict(max_bytes=b, recent_policy="tinylfu", pinned_top_k=500,
                                                          query_log=log, learn_hot=False))]
    with console.status("[bold]simulating cache tiers on the Zipf stream[/]") as st:
        for name, n, kw in configs:
            st.update(f"[bold]cache tiers[/]: {name}")
            rows.append({"tier": name, "recent_entries": n, "recent_mb": n * entry_bytes / 2**20,
                         "hit_ratio": measure(CacheConfig(**kw))})
    log.unlink()
    png = out_dir / "runtime_cache_hit_ratio.png"
    _plot(rows, png, args)
    return rows, png


def _plot(rows: list[dict], png: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix, style in (("LRU ", "o-"), ("TinyLFU ", "s-"), ("pinned 500 + TinyLFU ", "^-")):
        pts = [(r["recent_entries"], r["hit_ratio"]) for r in rows if r["tier"].startswith(prefix)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=prefix.strip())
    pinned = next(r["hit_ratio"] for r in rows if r["tier"] == "pinned top-500 only")
    ax.axhline(pinned, color="gray", ls="--", label="pinned top-500 only")
    ax.set_xscale("log")
    ax.set_xlabel("recent tier size (entries of 384 float32 + key)")
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1)
    ax.set_title(f"Zipf s={args.zipf_exponent}, {args.zipf_universe:,} distinct queries, "
                 f"{args.zipf_requests:,} requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# ---- part 3: cache-hit throughput ------------------------------------------------------
def bench_cache_hits(args) -> dict:
    import uvloop

    queries = short_queries(500, seed=1)
    with console.status("[bold]cache-hit throughput[/]"):
        with ServerProcess("--threads", str(args.threads)) as srv:
            wire = [encode_post("127.0.0.1", "/embed", {"inputs": [q]}) for q in queries]
            uvloop.run(closed_loop(srv.url, wire, 8, total=len(wire)))  # fill the cache
            r = run_load(srv.url, queries, args.hit_clients, args.seconds)
    return {"clients": args.hit_clients, "rps": r.throughput, "p50_ms": r.pct(50) * 1e3,
            "p99_ms": r.pct(99) * 1e3, "errors": sum(v for k, v in r.statuses.items() if k != 200)}


# ---- main ---------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="Measured seconds per mode (split into rounds).")
    ap.add_argument("--rounds", type=int, default=3, help="Alternating on/off rounds of the batching runs.")
    ap.add_argument("--clients", type=int, default=64, help="Closed-loop clients for the batching runs.")
    ap.add_argument("--hit-clients", type=int, default=8, help="Closed-loop clients for the cache-hit run.")
    ap.add_argument("--delay-ms", type=float, default=2.0, help="max_queue_delay of the batching-on server.")
    ap.add_argument("--max-batch", type=int, default=64, help="max_batch_size of the batching-on server.")
    ap.add_argument("--engine", choices=("onnxrt", "torch"), default="onnxrt",
                    help="Engine of the batching servers: onnxrt (default) or torch (its CPU path, encoder_cpu).")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="Compute precision of the engine (bf16: torch engine only; AMX GEMMs where available).")
    ap.add_argument("--instances", type=int, default=1, help="Engine instances per server.")
    ap.add_argument("--threads", type=int, default=1,
                    help="ONNX Runtime threads per server (0: all cores). 1 on a 2-core box: the event loop, tokenizer and "
                    "this load generator need the other core, and a 2-thread ORT run then waits on a busy core.")
    ap.add_argument("--zipf-exponent", type=float, default=0.85,
                    help="Zipf exponent; 0.85 over 200k queries puts ~30%% of traffic on the top 500.")
    ap.add_argument("--zipf-universe", type=int, default=200_000, help="Distinct queries in the Zipf stream.")
    ap.add_argument("--zipf-requests", type=int, default=200_000, help="Requests in the Zipf stream.")
    ap.add_argument("--parts", default="batching,hits,ratio", help="Comma-separated subset of parts to run.")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks", help="Where the PNG and JSON go.")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SURGE_CACHE_DIR", str(ROOT / ".pytest_cache" / "surge"))
    parts = set(args.parts.split(","))
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine":
                     f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
                     "command": " ".join(sys.argv)}

    if "batching" in parts:
        rows = results["batching"] = bench_batching(args)
        t = Table(title=f"{args.clients} closed-loop clients, 5-20 token queries, cache off ({args.seconds:g} s), "
                        f"engine {args.engine} {args.precision}, {args.threads} thread(s) x {args.instances}")
        for col in ("mode", "req/s", "p50 ms", "p99 ms", "mean batch", "engine ms/batch", "engine ms/input",
                    "errors"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["mode"], f"{r['rps']:.0f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                      f"{r['mean_batch']:.1f}", f"{r['compute_ms_per_batch']:.2f}", f"{r['compute_ms_per_input']:.2f}",
                      str(r["errors"]))
        console.print(t)
        off, on = rows
        console.print(f"batching on / off: throughput x{on['rps'] / off['rps']:.2f}, "
                      f"p99 x{on['p99_ms'] / off['p99_ms']:.2f}")
    if "ratio" in parts:
        rows, png = bench_hit_ratio(args, args.out)
        results["hit_ratio"] = rows
        share = top_share(args.zipf_universe, args.zipf_exponent)
        t = Table(title=f"Hit ratio, Zipf s={args.zipf_exponent} over {args.zipf_universe:,} queries "
                        f"(top 500 = {share:.1%} of traffic); warm on half the stream, measure the other half")
        for col in ("tier", "recent entries", "recent MiB", "hit ratio"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["tier"], str(r["recent_entries"]), f"{r['recent_mb']:.1f}", f"{r['hit_ratio']:.3f}")
        console.print(t)
        console.print(f"plot: {png}")
    if "hits" in parts:
        r = results["cache_hits"] = bench_cache_hits(args)
        console.print(f"cache hits over HTTP, {r['clients']} clients: {r['rps']:.0f} req/s, "
                      f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, errors {r['errors']}")
    (args.out / "runtime_results.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
