"""How fast `surge bench` itself can go: its request rate against a trivial server.

The trivial server (raw asyncio, keep-alive, a fixed one-row answer) runs in
its own process; the load generator runs here. Whatever rate this prints is
the most any benchmark on this machine can measure, so it should sit far above
the servers under test (on 2 cores surge and the baseline serve < 1,000 req/s).

    PYTHONPATH=src python benchmarks/serving_loadgen_ceiling.py [--cpu 1]

`--cpu N` pins the generator to CPU N (and the server to the other CPUs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

SERVER = textwrap.dedent("""
    import asyncio, sys
    BODY = b'{"embeddings":[[0.5]]}'
    RESP = b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n%s" % (len(BODY), BODY)
    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\\r\\n\\r\\n")
                n = 0
                for line in head.split(b"\\r\\n"):
                    if line[:15].lower() == b"content-length:":
                        n = int(line[15:])
                if n:
                    await reader.readexactly(n)
                writer.write(RESP)
        except Exception:
            writer.close()
    async def main():
        s = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
        print("ready", flush=True)
        async with s:
            await s.serve_forever()
    try:
        import uvloop; uvloop.run(main())
    except ImportError:
        asyncio.run(main())
""")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", type=int, default=None, help="pin the generator to this CPU")
    p.add_argument("--duration", type=float, default=3.0)
    args = p.parse_args()
    from rich.console import Console

    from surge.bench.cli_helpers import run_coro
    from surge.bench.loadgen import LoadSpec, run_load
    from surge.bench.report import summarize
    from surge.bench.servers import free_port
    from surge.bench.targets import NativeHTTP
    from surge.bench.workloads import make_workload

    port = free_port()
    preexec = None
    if args.cpu is not None:
        others = set(range(os.cpu_count() or 1)) - {args.cpu}
        preexec = (lambda: os.sched_setaffinity(0, others)) if others else None
        os.sched_setaffinity(0, {args.cpu})
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True,
                           preexec_fn=preexec)
    try:
        assert srv.stdout.readline().strip() == "ready"
        w = make_workload(2000)
        rows = []
        for spec in [LoadSpec(mode="closed", concurrency=c, duration_s=args.duration, warmup_s=0.5) for c in (1, 16, 64)] + \
                    [LoadSpec(mode="open", rate=r, concurrency=64, duration_s=args.duration, warmup_s=0.5)
                     for r in (1000, 2000, 4000)]:
            s = summarize(run_coro(run_load(NativeHTTP(f"http://127.0.0.1:{port}"), w.stream(), spec)))
            rows.append(s)
        console = Console()
        console.print(f"load generator ceiling ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                      f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, generator CPU {args.cpu})")
        print("| load | req/s | p50 ms | p99 ms | p99 send lag ms | errors |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for s in rows:
            print(f"| {s['label']} | {s['throughput_rps']:.0f} | {s['latency_ms']['p50']:.2f} | "
                  f"{s['latency_ms']['p99']:.2f} | {s['send_lag_ms_p99']:.2f} | {s['error_count']} |")
    finally:
        srv.terminate()
        srv.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
