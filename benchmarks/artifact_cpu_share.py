"""Where `surge serve --artifact` spends its CPU under load, per request: the event loop's thread
against the engine's threads (ONNX Runtime's and the executor's), FP32 against INT8, alternating.

    PYTHONPATH=src python3 benchmarks/artifact_cpu_share.py --fp32 FP32_DIR --int8 INT8_DIR \
        --texts HELD_OUT.txt [--rounds 2 --clients 64 --seconds 15 --threads 2 --instances 1]

Each round serves each artifact alone (`--threads N --instances M --cache-bytes 0`), warms it for 3 s, then runs
CLIENTS closed-loop keep-alive clients (`surge.bench.rawhttp`, one held-out text a request, OpenAI
/v1/embeddings) for SECONDS and reads every server thread's CPU time (/proc, psutil) before and after.
Prints req/s, p50 and the CPU microseconds a request of the loop's thread and of the other threads;
the last line is the engine threads' FP32/INT8 ratio, the end-to-end ratio a server with no cost
of its own would reach at these batches (the load generator shares the machine's cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _serve(art: str, port: int, threads: int, instances: int = 1) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "surge.cli.main", "serve", "--artifact", art, "--threads", str(threads),
           "--instances", str(instances), "--cache-bytes", "0", "--port", str(port), "--log-level", "warning"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1800):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
            return p
        except Exception:  # noqa: BLE001 - not up yet
            if p.poll() is not None:
                raise SystemExit(f"the server for {art} exited with {p.returncode}")
            time.sleep(0.2)
    raise SystemExit(f"the server for {art} did not get ready")


async def _load(port: int, clients: int, seconds: float, model: str, texts: list[str]):
    from surge.bench.rawhttp import RawConnection

    end = time.perf_counter() + seconds
    lat: list[float] = []

    async def one():
        c, rng = RawConnection("127.0.0.1", port), random.Random()
        while time.perf_counter() < end:
            body = json.dumps({"input": rng.choice(texts), "model": model}).encode()
            t = time.perf_counter()
            r = await c.request("/v1/embeddings", body)
            if r.status != 200:
                raise SystemExit(f"status {r.status}: {r.body[:200]!r}")
            lat.append(time.perf_counter() - t)
        c.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return lat


def _threads(pid: int) -> dict[int, float]:
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def measure(art: str, port: int, args, texts: list[str]) -> dict:
    p = _serve(art, port, args.threads, args.instances)
    try:
        model = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))["data"][0]["id"]
        asyncio.run(_load(port, args.clients, 3.0, model, texts))
        c0, t0 = _threads(p.pid), time.perf_counter()
        lat = asyncio.run(_load(port, args.clients, args.seconds, model, texts))
        wall, c1 = time.perf_counter() - t0, _threads(p.pid)
    finally:
        p.terminate()
        p.wait(60)
    n = len(lat)
    loop = c1.get(p.pid, 0.0) - c0.get(p.pid, 0.0)  # the main thread runs the event loop
    other = sum(v - c0.get(k, 0.0) for k, v in c1.items() if k != p.pid)
    return {"artifact": art, "req_s": n / wall, "p50_ms": statistics.median(lat) * 1e3,
            "loop_us": loop / n * 1e6, "other_us": other / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32", required=True)
    ap.add_argument("--int8", required=True)
    ap.add_argument("--texts", required=True, help="one query a line (the held-out corpus)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--instances", type=int, default=1, help="engine instances (the issue's layout: --threads 1 --instances 2)")
    ap.add_argument("--port", type=int, default=18640)
    args = ap.parse_args()
    texts = [t.strip() for t in Path(args.texts).read_text().splitlines() if t.strip()]
    rows = []
    print("| round | artifact | req/s | p50 ms | loop thread us/request | other threads us/request |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for name, art in (("fp32", args.fp32), ("int8", args.int8)):
            m = measure(art, args.port + r, args, texts) | {"name": name}
            rows.append(m)
            print(f"| {r + 1} | {name} | {m['req_s']:,.0f} | {m['p50_ms']:.1f} | {m['loop_us']:.0f} | {m['other_us']:.0f} |",
                  flush=True)
    med = {k: {f: statistics.median(x[f] for x in rows if x["name"] == k) for f in ("req_s", "loop_us", "other_us")}
           for k in ("fp32", "int8")}
    print(f"\nmedians: end to end INT8/FP32 {med['int8']['req_s'] / med['fp32']['req_s']:.2f}x; engine threads "
          f"{med['fp32']['other_us'] / med['int8']['other_us']:.2f}x; with the loop's CPU as measured "
          f"{(med['fp32']['other_us'] + med['fp32']['loop_us']) / (med['int8']['other_us'] + med['int8']['loop_us']):.2f}x")


if __name__ == "__main__":
    main()
