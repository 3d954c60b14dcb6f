"""The engine process's IPC + batcher loop alone: req/s and engine-process CPU per request.

A real EngineServer (runtime/ipc.py) over a real DynamicBatcher whose engine is a stand-in that
sleeps `--engine-ms` per batch and returns rows of zeros: what is measured is the loop (frames,
enqueueing, batching, answers), not a model. P client processes (real EngineClients) keep C
requests of 12 tokens each in flight. `--poll-us N` runs the engine in halves as the CUDA engines
do (launch returns at once, the batch is "done" engine-ms later) with the batcher checking it on its
loop for up to N us before a thread waits; `--concurrency 1` then reads the IPC + batcher round trip
a lone request pays (p50 minus engine-ms).

    PYTHONPATH=src python3 benchmarks/ipc_loop.py --procs 1 --concurrency 64 --seconds 4
    PYTHONPATH=src python3 benchmarks/ipc_loop.py --procs 1 --concurrency 1 --poll-us 2000
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from surge.cli.workers_engine import run_loop  # noqa: E402  (uvloop where installed)


def _engine(sock: str, engine_ms: float, poll_us: float | None) -> None:
    from surge.runtime import ipc
    from surge.runtime.batcher import BatcherConfig, DynamicBatcher

    def run(items):
        time.sleep(engine_ms / 1000)
        return np.zeros((len(items), 384), np.float32)

    def launch(items):
        return time.monotonic() + engine_ms / 1000, len(items)

    def wait(pending):
        time.sleep(max(0.0, pending[0] - time.monotonic()))

    def ready(pending):
        return time.monotonic() >= pending[0]

    def collect(pending):
        return np.zeros((pending[1], 384), np.float32)

    split = None if poll_us is None else (launch, wait, collect, ready)

    async def main():
        b = DynamicBatcher(run, ThreadPoolExecutor(1), BatcherConfig(max_batch_size=64), split=split,
                           poll_s=(poll_us or 0) / 1e6)
        await ipc.EngineServer(b, {"bench": True}).serve(sock)
        await asyncio.Event().wait()

    run_loop(main())


def _client(sock: str, concurrency: int, seconds: float, q) -> None:
    from surge.runtime import ipc
    from surge.types import Encoded

    async def main():
        c = ipc.EngineClient(sock)
        await c.connect()
        items = [Encoded(np.arange(100, 112, dtype=np.int64), np.zeros(12, np.int64))]
        lat = []
        end = time.perf_counter() + seconds

        async def one():
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                await c.submit(items, time.monotonic() + 10)
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(concurrency)))
        return lat

    out = []

    async def wrap():
        out.append(await main())

    run_loop(wrap())
    q.put(out[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--engine-ms", type=float, default=0.3)
    p.add_argument("--poll-us", type=float, default=None, help="split engine, polled on the loop up to N us")
    args = p.parse_args()
    import psutil

    sock = os.path.join(tempfile.mkdtemp(), "engine.sock")
    ctx = mp.get_context("spawn")
    eng = ctx.Process(target=_engine, args=(sock, args.engine_ms, args.poll_us), daemon=True)
    eng.start()
    while not os.path.exists(sock):
        time.sleep(0.05)
    q = ctx.Queue()
    clients = [ctx.Process(target=_client, args=(sock, args.concurrency, args.seconds, q)) for _ in range(args.procs)]
    ep = psutil.Process(eng.pid)
    c0 = ep.cpu_times()
    for c in clients:
        c.start()
    lat = np.concatenate([np.asarray(q.get()) for _ in clients])
    total = len(lat)
    c1 = ep.cpu_times()
    for c in clients:
        c.join()
    eng.terminate()
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    mode = "whole" if args.poll_us is None else f"split, poll {args.poll_us:g} us"
    print("| client processes | in flight each | engine | req/s | p50 ms | p99 ms | engine-process CPU per request |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    print(f"| {args.procs} | {args.concurrency} | {mode} | {total / args.seconds:,.0f} | {np.median(lat) * 1e3:.3f} | "
          f"{np.percentile(lat, 99) * 1e3:.3f} | {cpu / max(total, 1) * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
