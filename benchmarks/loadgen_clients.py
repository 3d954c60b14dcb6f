"""The load generator's own cost: CPU per request of aiohttp's client against surge.bench.rawhttp.

Both drive the same trivial server (benchmarks/serving_loadgen_ceiling.py's: raw asyncio,
keep-alive, a fixed answer) in its own process, with the same closed loop and bodies, alternating
round by round; the generator's CPU time (os.times) per request is what `benchmarks/gpu_serving.py`
takes from the cores it shares with the server under test.

    PYTHONPATH=src python3 benchmarks/loadgen_clients.py [--clients 16] [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))


async def _aiohttp(port: int, clients: int, seconds: float, body: bytes) -> int:
    import aiohttp

    done = 0
    end = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one():
            nonlocal done
            while time.perf_counter() < end:
                async with s.post(f"http://127.0.0.1:{port}/embed", data=body,
                                  headers={"content-type": "application/json"}) as r:
                    await r.read()
                    assert r.status == 200
                done += 1

        await asyncio.gather(*(one() for _ in range(clients)))
    return done


async def _raw(port: int, clients: int, seconds: float, body: bytes) -> int:
    from surge.bench.rawhttp import RawConnection

    done = 0
    end = time.perf_counter() + seconds

    async def one():
        nonlocal done
        conn = RawConnection("127.0.0.1", port)
        try:
            while time.perf_counter() < end:
                r = await conn.request("/embed", body)
                assert r.status == 200
                done += 1
        finally:
            conn.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import orjson

    from serving_loadgen_ceiling import SERVER
    from surge.bench.cli_helpers import run_coro
    from surge.bench.servers import free_port

    port = free_port()
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        body = orjson.dumps({"input": "how do I reset my password on the new phone?", "model": "m"})
        res: dict[str, list[tuple[float, float]]] = {"aiohttp": [], "rawhttp": []}
        for _ in range(args.rounds):
            for name, fn in (("aiohttp", _aiohttp), ("rawhttp", _raw)):
                t0 = os.times()
                n = run_coro(fn(port, args.clients, args.seconds, body))
                t1 = os.times()
                cpu = (t1.user + t1.system) - (t0.user + t0.system)
                res[name].append((n / args.seconds, cpu / max(n, 1) * 1e6))
    finally:
        srv.kill()
    print(f"| client | req/s (median of {args.rounds}) | generator CPU per request, us (median) |")
    print("|---|---:|---:|")
    med = {}
    for name, rows in res.items():
        med[name] = statistics.median(c for _, c in rows)
        print(f"| {name} | {statistics.median(r for r, _ in rows):,.0f} | {med[name]:.1f} |")
    print(f"\naiohttp / rawhttp CPU per request: {med['aiohttp'] / med['rawhttp']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
