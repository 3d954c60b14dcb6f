"""What the generation routes cost the server's event loop: CPU a request and CPU a streamed chunk.

    PYTHONPATH=src python3 benchmarks/generate_route_cpu.py --rounds 5

`surge serve` with a tiny random decoder (tests/decoder_models.py) and its engine loop in a process of
its own (`engine_process=true`), so the server's main thread does only the HTTP side: parsing,
validation, the stream's deltas, detokenization, SSE chunks. Its CPU time (psutil, the main thread
alone) is read around each batch of requests from one client process:

* a request: `--requests` streaming completions of one token each (`max_tokens=1`): the request's
  whole cycle with a single chunk;
* a chunk: the same number of streams of `--tokens` tokens each; (CPU - requests' CPU) / extra chunks.

Medians over `--rounds`; the table also gives chat completions, the Responses API and Anthropic's Messages
API (their streams' typed events: a few more at the start and the end, one a token). `--baseline CHECKOUT` (a git worktree
of the commit to compare with) measures that checkout's server too, rounds alternating with this
one's, and gives the ratio: the machine's speed moves within a session as well as between them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))


def main_thread_cpu(proc) -> float:
    for t in proc.threads():
        if t.id == proc.pid:
            return t.user_time + t.system_time
    raise RuntimeError("no main thread")


async def batch(url: str, n: int, body: dict, path: str, concurrency: int) -> int:
    """n streams, `concurrency` at a time; returns the SSE data chunks received."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    chunks = 0

    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        async def one():
            nonlocal chunks
            async with sem:
                async with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks += 1

        await asyncio.gather(*(one() for _ in range(n)))
    return chunks


def measure(proc, url, n, body, path, concurrency):
    c0 = main_thread_cpu(proc)
    chunks = asyncio.run(batch(url, n, body, path, concurrency))
    return main_thread_cpu(proc) - c0, chunks


def main(argv=None) -> int:
    import contextlib

    import psutil

    from surge.bench.servers import ServerProc, free_port
    from tests.decoder_models import CHATML, build_model  # noqa: F401  (the model the e2e tests use)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--engine", choices=["process", "thread"], default="process",
                    help="the engine loop in its own process (the main thread does only HTTP work) or on a thread")
    ap.add_argument("--baseline", type=Path,
                    help="another checkout (e.g. a git worktree of an older commit): its server is measured too, "
                         "rounds alternating with this checkout's, and the table gives the ratio")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    roots = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    ask = [{"role": "user", "content": "Define assignment."}]
    kinds = {  # name: (path, body, the field of the output's length)
        "completions": ("/v1/completions", {"model": "m", "prompt": "The augmented assignment statement",
                                            "temperature": 0, "ignore_eos": True, "stream": True}, "max_tokens"),
        "chat": ("/v1/chat/completions", {"model": "m", "temperature": 0, "ignore_eos": True, "stream": True,
                                          "messages": ask}, "max_tokens"),
        "responses": ("/v1/responses", {"model": "m", "temperature": 0, "ignore_eos": True, "stream": True,
                                        "input": ask, "store": False}, "max_output_tokens"),
        "messages": ("/v1/messages", {"model": "m", "temperature": 0, "ignore_eos": True, "stream": True,
                                      "messages": ask}, "max_tokens"),
    }
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = build_model("qwen2", Path(tmp) / "m", seed=4)
        servers = {}
        for variant, root in roots.items():
            port = free_port()
            argv = [sys.executable, "-m", "surge.cli.main", "serve", str(model), "--port", str(port), "--grpc-port",
                    "0", "--threads", "1", "--model-name", "m", "--generation",
                    f"engine_process={args.engine == 'process'},cache_entries=0,prefix_caching=false,max_num_seqs=32"]
            srv = stack.enter_context(ServerProc(f"surge-serve ({variant})", argv, port, cwd=root,
                                                 env={"PYTHONPATH": str(root / "src")}))
            servers[variant] = (srv, psutil.Process(srv.proc.pid))
        for name, (path, body, length) in kinds.items():
            per = {v: ([], []) for v in servers}
            for srv, proc in servers.values():
                measure(proc, srv.url, 8, {**body, length: 4}, path, args.concurrency)  # warm-up
            for _ in range(args.rounds):
                for variant, (srv, proc) in servers.items():  # alternating: the machine's drift hits both
                    cpu1, ch1 = measure(proc, srv.url, args.requests, {**body, length: 1}, path, args.concurrency)
                    cpun, chn = measure(proc, srv.url, args.requests, {**body, length: args.tokens}, path,
                                        args.concurrency)
                    per[variant][0].append(cpu1 / args.requests)
                    per[variant][1].append((cpun - cpu1) / max(1, chn - ch1))
            for variant, (per_req, per_chunk) in per.items():
                rows[f"{name} ({variant})"] = {
                    "request_ms": 1e3 * statistics.median(per_req), "chunk_us": 1e6 * statistics.median(per_chunk),
                    "rounds_request_ms": [round(1e3 * x, 3) for x in per_req],
                    "rounds_chunk_us": [round(1e6 * x, 1) for x in per_chunk]}
                print(f"{name} ({variant}): {rows[f'{name} ({variant})']}", flush=True)
    print(f"\nthe server's main thread (engine loop: {args.engine}), medians of {args.rounds} rounds, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          + (f"; baseline: {args.baseline}" if args.baseline else ""))
    print("| route | CPU a streamed request (1 token) ms | CPU a further chunk us |")
    print("| --- | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['request_ms']:.3f} | {r['chunk_us']:.1f} |")
    if args.baseline:
        for name in kinds:
            if f"{name} (baseline)" not in rows:
                continue
            new, old = rows[f"{name} (this)"], rows[f"{name} (baseline)"]
            print(f"| {name}: this / baseline | {new['request_ms'] / old['request_ms']:.2f}x | "
                  f"{new['chunk_us'] / old['chunk_us']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
