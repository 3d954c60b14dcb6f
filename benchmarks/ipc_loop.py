"""The engine process's IPC + batcher loop alone: req/s and engine-process CPU per request.

A real EngineServer (runtime/ipc.py) over a real DynamicBatcher whose engine is a stand-in that
sleeps `--engine-ms` per batch and returns rows of zeros: what is measured is the loop (frames,
enqueueing, batching, answers), not a model. P client processes (real EngineClients) keep C
requests of 12 tokens each in flight.

    PYTHONPATH=src python3 benchmarks/ipc_loop.py --procs 1 --concurrency 64 --seconds 4
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


def _engine(sock: str, engine_ms: float) -> None:
    from surge.runtime import ipc
    from surge.runtime.batcher import BatcherConfig, DynamicBatcher

    def run(items):
        time.sleep(engine_ms / 1000)
        return np.zeros((len(items), 384), np.float32)

    async def main():
        b = DynamicBatcher(run, ThreadPoolExecutor(1), BatcherConfig(max_batch_size=64))
        await ipc.EngineServer(b, {"bench": True}).serve(sock)
        await asyncio.Event().wait()

    _run_loop(main())


def _run_loop(coro) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def _client(sock: str, concurrency: int, seconds: float, q) -> None:
    from surge.runtime import ipc
    from surge.types import Encoded

    async def main():
        c = ipc.EngineClient(sock)
        await c.connect()
        items = [Encoded(np.arange(100, 112, dtype=np.int64), np.zeros(12, np.int64))]
        done = 0
        end = time.perf_counter() + seconds

        async def one():
            nonlocal done
            while time.perf_counter() < end:
                await c.submit(items, time.monotonic() + 10)
                done += 1

        await asyncio.gather(*(one() for _ in range(concurrency)))
        return done

    out = []

    async def wrap():
        out.append(await main())

    _run_loop(wrap())
    q.put(out[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--engine-ms", type=float, default=0.3)
    args = p.parse_args()
    import psutil

    sock = os.path.join(tempfile.mkdtemp(), "engine.sock")
    ctx = mp.get_context("spawn")
    eng = ctx.Process(target=_engine, args=(sock, args.engine_ms), daemon=True)
    eng.start()
    while not os.path.exists(sock):
        time.sleep(0.05)
    q = ctx.Queue()
    clients = [ctx.Process(target=_client, args=(sock, args.concurrency, args.seconds, q)) for _ in range(args.procs)]
    ep = psutil.Process(eng.pid)
    c0 = ep.cpu_times()
    for c in clients:
        c.start()
    total = sum(q.get() for _ in clients)
    c1 = ep.cpu_times()
    for c in clients:
        c.join()
    eng.terminate()
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    print(f"| client processes | in flight each | req/s | engine-process CPU per request |")
    print(f"|---:|---:|---:|---:|")
    print(f"| {args.procs} | {args.concurrency} | {total / args.seconds:,.0f} | {cpu / max(total, 1) * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
