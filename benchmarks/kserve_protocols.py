"""What the KServe v2 protocol layers cost next to surge's native API.

Starts one `surge serve` (HTTP + gRPC) and sends the same real sentences over:
native POST /embed (the baseline), KServe v2 HTTP with JSON tensors, KServe v2
HTTP with binary tensors (tritonclient.http), and KServe v2 gRPC
(tritonclient.grpc). Reports per-request latency (one client, sequential:
median, p99; protocols interleaved request by request) and throughput with
concurrent clients (median of alternating rounds), each as a ratio to the
baseline, and writes a PNG.

    python benchmarks/kserve_protocols.py [--requests 60] [--concurrency 8] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "all-MiniLM-L6-v2"


def make_callers(srv, texts_per_request: int):
    """Factories of per-thread callables: protocol -> () -> call(texts) -> [n, 384] array."""
    import httpx
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    def native():
        c = httpx.Client(base_url=srv.url, timeout=60)
        return lambda texts: np.asarray(c.post("/embed", json={"inputs": texts}).json()["embeddings"])

    def v2_json():
        c = httpx.Client(base_url=srv.url, timeout=60)

        def call(texts):
            body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
            out = c.post(f"/v2/models/{MODEL}/infer", json=body).json()["outputs"][0]
            return np.asarray(out["data"]).reshape(out["shape"])
        return call

    def triton(mod, url):
        def factory():
            c = mod.InferenceServerClient(url)

            def call(texts):
                inp = mod.InferInput("text", [len(texts)], "BYTES")
                inp.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
                return c.infer(MODEL, [inp]).as_numpy("embedding")
            return call
        return factory

    return {
        "native /embed (baseline)": native,
        "v2 HTTP JSON": v2_json,
        "v2 HTTP binary (tritonclient)": triton(thttp, srv.url.removeprefix("http://")),
        "v2 gRPC (tritonclient)": triton(tgrpc, srv.grpc_url),
    }


def latencies(calls: dict, batches, warmup=5) -> dict[str, np.ndarray]:
    """Per-request ms for every protocol, interleaved request by request (in a
    rotating order) so that load from elsewhere on the machine hits all alike."""
    names = list(calls)
    for b in batches[:warmup]:
        for n in names:
            calls[n](b)
    out = {n: np.empty(len(batches)) for n in names}
    for i, b in enumerate(batches):
        for n in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            calls[n](b)
            out[n][i] = (time.perf_counter() - t0) * 1e3
    return out


def throughput(factory, batches, concurrency: int) -> float:
    """Inputs per second with `concurrency` clients sharing the batches."""
    barrier = threading.Barrier(concurrency + 1)
    errors: list[BaseException] = []

    def run(k):
        try:
            call = factory()  # in its own thread: tritonclient.http's gevent client is bound to one
            call(batches[0])
        except BaseException as exc:
            errors.append(exc)
        barrier.wait()
        try:
            for b in batches[k::concurrency]:
                call(b)
        except BaseException as exc:  # a failed client must not look like a fast one
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}")
    return sum(len(b) for b in batches) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "benchmarks" / "kserve_protocols.png")
    args = ap.parse_args()

    from rich.progress import track

    from surge.data import load_sentences
    from tests.server_process import ServerProcess

    sentences = load_sentences()
    rng = np.random.default_rng(0)
    rows = []
    with ServerProcess("--threads", str(args.threads), "--cache-bytes", "0", "--request-timeout-s", "300",
                       grpc=True) as srv:
        for per_request in (1, 8):
            batches = [list(rng.choice(sentences, per_request)) for _ in range(args.requests)]
            factories = make_callers(srv, per_request)
            calls = {name: f() for name, f in factories.items()}
            reference = calls["native /embed (baseline)"](batches[0])
            for name, call in calls.items():
                assert np.allclose(call(batches[0]), reference, atol=1e-5), f"{name} answers differently"
            lat = latencies(calls, batches)
            # Throughput: rounds alternate between protocols; the median round counts.
            tputs = {name: [] for name in factories}
            for _ in track(range(args.rounds), description=f"{per_request} input(s)/request"):
                for name, factory in factories.items():
                    tputs[name].append(throughput(factory, batches, args.concurrency))
            rows += [(per_request, name, lat[name], float(np.median(tputs[name]))) for name in factories]

    print(f"\nsurge serve (all-MiniLM-L6-v2, ONNX Runtime, {args.threads} threads, cache off), "
          f"{args.requests} requests per cell, {args.concurrency} concurrent clients for throughput, "
          f"{platform.processor() or platform.machine()}")
    head = f"{'inputs/req':>10} | {'protocol':<30} | {'p50 ms':>7} {'p99 ms':>7} {'p50 vs base':>11} | " \
           f"{'inputs/s':>9} {'vs base':>8}"
    print(head)
    print("-" * len(head))
    base = {}
    for per_request, name, lat, tput in rows:
        if "baseline" in name:
            base[per_request] = (np.median(lat), tput)
        b50, btp = base[per_request]
        print(f"{per_request:>10} | {name:<30} | {np.median(lat):>7.2f} {np.percentile(lat, 99):>7.2f} "
              f"{np.median(lat) / b50:>10.2f}x | {tput:>9.0f} {tput / btp:>7.2f}x")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(dict.fromkeys(r[1] for r in rows))
    width = 0.38
    for i, per_request in enumerate((1, 8)):
        sel = [r for r in rows if r[0] == per_request]
        x = np.arange(len(sel)) + (i - 0.5) * width
        axes[0].bar(x, [np.median(r[2]) for r in sel], width, label=f"{per_request} input(s)/request")
        axes[1].bar(x, [r[3] for r in sel], width, label=f"{per_request} input(s)/request")
    for ax, title in zip(axes, ("median latency, one client (ms)", f"inputs/s, {args.concurrency} clients")):
        ax.set_xticks(np.arange(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
