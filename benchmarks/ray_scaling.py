"""Throughput and p99 of surge on Ray Serve with 1, 2 and 4 replicas at 64 clients.

Baseline in the same run: one replica (ratios are against it), plus a plain
`surge serve` process (no Ray) with the same cores. Each replica reserves
--cpus-per-replica CPUs and runs that many ORT threads (at least 1), so scaling
is near-linear until the machine's cores run out.

    PYTHONPATH=src python benchmarks/ray_scaling.py                  # 1,2,4 replicas, 64 clients
    PYTHONPATH=src python benchmarks/ray_scaling.py --duration 20 --rounds 3 --plot docs/benchmarks/ray.png

The load generator (surge's own, bench/loadgen.py, one process) runs on the same machine and takes CPU
from the replicas; the report says how many cores there were. Throughput is `surge bench`'s: completions
inside the measured window over its length (warm-up and drain excluded), so the numbers compare with it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def load(url: str, texts: list[str], clients: int, duration: float, per_request: int = 1,
         warmup: float = 0.0) -> dict:
    """`clients` closed-loop clients of surge's load generator (bench/loadgen.py), `per_request`
    texts a request: one on the native /embed, more on OpenAI /v1/embeddings with base64
    vectors (the proxy and the ingress move 1.5 KB a vector instead of a JSON float list).

    Throughput and latency are `surge bench`'s own (bench/report.py `summarize`): successful completions
    inside the measurement window over its length, warm-up and the drain after the window excluded, so these
    numbers compare with `surge bench run`'s."""
    from surge.bench.loadgen import LoadSpec, run_load
    from surge.bench.report import summarize
    from surge.bench.targets import NativeHTTP, OpenAIHTTP

    target = (NativeHTTP(url, timeout_s=60) if per_request == 1
              else OpenAIHTTP(url, timeout_s=60, encoding_format="base64"))
    spec = LoadSpec(mode="closed", concurrency=clients, duration_s=duration, warmup_s=warmup,
                    inputs_per_request=per_request)
    s = summarize(asyncio.run(run_load(target, itertools.cycle(texts), spec)))
    nan = float("nan")
    lat = s["latency_ms"]
    return {"rps": s["throughput_rps"], "texts_s": s["inputs_per_s"],
            "p50": nan if lat["p50"] is None else lat["p50"], "p99": nan if lat["p99"] is None else lat["p99"],
            "errors": s["error_count"]}


def measure(url: str, texts: list[str], args, label: str, running=None) -> dict:
    rounds = []
    for r in range(args.rounds):  # the first round's warm-up fills batches and connections
        rounds.append(load(url, texts, args.clients, args.duration, args.texts_per_request,
                           args.warmup if r == 0 else 0.0))
        console.print(f"  {label} round {r + 1}: {rounds[-1]['rps']:.0f} req/s, p99 {rounds[-1]['p99']:.0f} ms")
    med = {k: statistics.median(x[k] for x in rounds) for k in ("rps", "texts_s", "p50", "p99")}
    med["errors"] = sum(x["errors"] for x in rounds)
    med["replicas_running"] = running() if running else 0
    return med


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plain_process(texts, args, artifact_cache: Path) -> dict:
    """The baseline without Ray: one `surge serve` process with all the cores."""
    import signal

    port = free_port()
    env = {**os.environ, "SURGE_CACHE_DIR": str(artifact_cache)}
    model = [str(args.model_dir)] if args.model_dir else []
    proc = subprocess.Popen([sys.executable, "-m", "surge.cli.main", "serve", *model, "--port", str(port),
                             "--grpc-port", "0", "--threads", str(args.cores), "--cache-bytes", "0",
                             "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise TimeoutError("surge serve did not get ready")
        return measure(url, texts, args, "plain process")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="1,2,4", help="Replica counts to measure.")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0, help="Seconds per measured round.")
    p.add_argument("--rounds", type=int, default=3, help="Rounds per configuration (the median is reported).")
    p.add_argument("--warmup", type=float, default=3.0, help="Seconds of load before measuring.")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs (and ORT threads) per replica.")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="CPUs Ray may use (default: all).")
    p.add_argument("--worker-niceness", type=int, default=0,
                   help="Nice value of Ray's workers (Ray's default is 15, which loses the CPU to any other "
                        "process on a shared machine; 0 puts replicas on a par with the plain process).")
    p.add_argument("--no-plain", action="store_true", help="Skip the plain `surge serve` baseline.")
    p.add_argument("--texts-per-request", type=int, default=1,
                   help="Texts a request (more than 1: /v1/embeddings, base64 vectors).")
    p.add_argument("--ingress-replicas", type=int, default=1, help="Replicas of the HTTP ingress deployment.")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="Hugging Face model directory to serve (default: the bundled MiniLM).")
    p.add_argument("--plot", type=Path, default=None, help="Write a PNG of throughput and p99 per replica count.")
    p.add_argument("--markdown", type=Path, default=None, help="Also write the table as markdown here.")
    args = p.parse_args()

    import ray
    from ray import serve

    from surge.cli.bootstrap import resolve_artifact
    from surge.config import CacheConfig, EngineConfig, ServerConfig, default_cache_dir
    from surge.data import load_sentences
    from surge.distributed.config import RayDeploymentConfig
    from surge.distributed.ray_serve import connect, deploy, plan_single, replica_states

    texts = load_sentences()
    counts = [int(x) for x in args.replicas.split(",")]
    # The cache is off: every request is computed, so this measures compute scaling.
    config = ServerConfig(port=free_port(), grpc_port=None, cache=CacheConfig(enabled=False), model_dir=args.model_dir,
                          engine=EngineConfig(warmup_shapes=[(1, 16), (32, 32)]))
    console.print(f"[bold]surge on Ray Serve[/]: replicas {counts}, {args.clients} clients, "
                  f"{args.cpus_per_replica:g} CPU per replica, {args.cores} cores for Ray "
                  f"(machine: {os.cpu_count()} cores)")
    rows = []
    if not args.no_plain:
        rows.append(("plain surge serve", args.cores, run_plain_process(texts, args, default_cache_dir())))
    # Ray may schedule more CPUs than the machine has, so that 4 replicas of 1 CPU fit
    # on 2 cores: that oversubscription is what the rows past the core count show.
    connect(None, num_cpus=max(args.cores, max(counts) * args.cpus_per_replica), http_host=config.host,
            http_port=config.port, _system_config={"worker_niceness": args.worker_niceness})
    try:
        for n in counts:
            ray_cfg = RayDeploymentConfig(num_replicas=n, num_cpus=args.cpus_per_replica)
            targets = plan_single(config, ray_cfg, resolve=resolve_artifact)
            with console.status(f"deploying {n} replica(s)"):
                deploy(targets, config, ingress_replicas=args.ingress_replicas)
            running = lambda: sum(d.get("RUNNING", 0) for d in replica_states().values())  # noqa: E731
            rows.append((f"Ray Serve, {n} replica(s)", n, measure(f"http://127.0.0.1:{config.port}", texts, args,
                                                                   f"{n} replica(s)", running)))
    finally:
        serve.shutdown()
        ray.shutdown()

    base = next((m for label, _, m in rows if label.startswith("Ray Serve, 1 ")), rows[0][2])
    table = Table(title=f"surge on Ray Serve, {args.clients} clients, {args.ingress_replicas} ingress replica(s), "
                        f"{args.cores} cores")
    for col in ("configuration", "req/s (median)", "texts/s", "req/s vs 1 replica (higher is better)", "p50 ms", "p99 ms", "replicas running",
                "errors"):
        table.add_column(col, justify="right" if col != "configuration" else "left")
    md = [f"{args.texts_per_request} text(s) a request, {args.clients} clients, "
          f"{args.ingress_replicas} ingress replica(s), {args.cores} cores for Ray (machine: {os.cpu_count()}).", "",
          "| configuration | req/s (median) | texts/s | req/s vs 1 replica (higher is better) | p50 ms | p99 ms | replicas running | errors |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, _, m in rows:
        cells = [label, f"{m['rps']:.0f}", f"{m['texts_s']:.0f}", f"{m['rps'] / base['rps']:.2f}", f"{m['p50']:.0f}",
                 f"{m['p99']:.0f}", str(m["replicas_running"] or "-"), str(m["errors"])]
        table.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    short = [label for label, _, m in rows if m["p50"] > 500 * args.duration]
    if short:  # requests that outlast half a round: a round counts too few of them to give a rate
        md += ["", f"Unreliable rate (p50 over half of the {args.duration:g} s round; use a longer --duration "
                   f"or fewer --clients): {', '.join(short)}."]
    Console(width=120).print(table)
    print("\n".join(md))
    if args.markdown:
        args.markdown.write_text("\n".join(md) + "\n")
    if args.plot:
        plot(rows, args)


def plot(rows, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ray_rows = [(n, m) for label, n, m in rows if label.startswith("Ray")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [n for n, _ in ray_rows]
    a.plot(xs, [m["rps"] for _, m in ray_rows], "o-", label="Ray Serve")
    a.plot(xs, [ray_rows[0][1]["rps"] * n / xs[0] for n in xs], "--", color="grey", label="linear")
    a.axvline(args.cores / args.cpus_per_replica, color="red", lw=0.8, label="cores run out")
    a.set(xlabel="replicas", ylabel="requests/s", title=f"throughput, {args.clients} clients")
    a.legend()
    b.plot(xs, [m["p99"] for _, m in ray_rows], "o-")
    b.set(xlabel="replicas", ylabel="ms", title="p99 latency")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    console.print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
