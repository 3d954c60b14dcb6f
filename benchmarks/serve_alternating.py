"""Several `surge serve --artifact` setups against each other end to end, alternating round by round.

Each entry is NAME=ARTIFACT or NAME=ARTIFACT@SRC (serve that artifact with the surge source tree SRC,
e.g. a `git worktree` of an older commit, to compare server code on one artifact), optionally followed by
`::FLAGS`, `surge serve` flags of that entry alone (after --serve-args), e.g. `int8-b8=ART::--max-batch-size 8`;
leading `KEY=VALUE` words of FLAGS are that server's environment variables instead. Every round serves each
entry alone (same flags), drives it with `surge bench run` (64 closed-loop clients on the held-out
queries, cache off) and stops it; the table has every round and the medians, each against the first entry.

    PYTHONPATH=src python3 benchmarks/serve_alternating.py --rounds 3 --serve-args "--threads 1 --instances 2" \\
        fp32=FP32_ART int8=INT8_ART [old=INT8_ART@/tmp/old/src]

Numbers: docs/benchmarks/optimizer.md, issue 21, session 8.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
sys.path.insert(0, str(SRC))


def serve_once(name: str, artifact: str, src: str, serve_args: list[str], clients: int, duration: float,
               queries: Path, work: Path, cores: str | None, env: dict | None = None) -> dict:
    from surge.bench.servers import ServerProc, free_port, surge_serve_argv

    port = free_port()
    argv = surge_serve_argv(port, "--artifact", artifact, "--cache-bytes", "0", *serve_args)
    pin = ["taskset", "-c", cores] if cores else []
    # the server runs SRC's code; the load generator always this tree's
    with ServerProc(name, pin + argv, port, env={"PYTHONPATH": src, **(env or {})}) as srv:
        report = work / f"{name}.json"
        subprocess.run(pin + [sys.executable, "-m", "surge.cli.main", "bench", "run", srv.url, "-p", "openai",
                              "-c", str(clients), "-d", str(duration), "--warmup", "5", "--query-log", str(queries),
                              "--json", str(report), "--no-progress", "--name", name],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(SRC)})
    run = json.loads(report.read_text())["runs"][name][0]
    return {"rps": run["throughput_rps"], "p50_ms": run["latency_ms"]["p50"], "p99_ms": run["latency_ms"]["p99"],
            "errors": run["error_count"]}


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from surge.data import heldout_queries

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("entries", nargs="+", help="NAME=ARTIFACT or NAME=ARTIFACT@SRC")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--serve-args", default="--threads 1 --instances 2", help="the same `surge serve` flags for all")
    p.add_argument("--cores", default=None, help="taskset core list for servers and load generator (default: all)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    entries = []
    for e in a.entries:
        name, _, rest = e.partition("=")
        rest, _, flags = rest.partition("::")
        artifact, _, src = rest.partition("@")
        words = shlex.split(flags)
        env = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        entries.append((name, artifact, src or str(SRC), words, env))
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="surge-alt-"))
    queries = work / "queries.txt"
    queries.write_text("\n".join(heldout_queries()) + "\n")
    rounds: list[dict] = []
    for r in range(a.rounds):
        row = {}
        for name, artifact, src, flags, env in entries:
            row[name] = serve_once(name, artifact, src, shlex.split(a.serve_args) + flags, a.clients, a.duration, queries,
                                   work, a.cores, env)
            console.print(f"round {r + 1} {name}: {row[name]['rps']:.1f} req/s, p50 {row[name]['p50_ms']:.1f} ms, "
                          f"errors {row[name]['errors']}")
        rounds.append(row)
    first = entries[0][0]
    table = Table(title=f"{a.clients} clients, {a.duration:.0f} s a server, `{a.serve_args}`, {a.rounds} rounds")
    for col in ("setup", *[f"round {i + 1} req/s" for i in range(a.rounds)], "median req/s", f"x {first} (median of per-round)"):
        table.add_column(col, justify="right")
    for name, *_ in entries:
        rps = [row[name]["rps"] for row in rounds]
        ratio = statistics.median(row[name]["rps"] / row[first]["rps"] for row in rounds)
        table.add_row(name, *[f"{x:.0f}" for x in rps], f"{statistics.median(rps):.0f}", f"{ratio:.3f}")
    console.print(table)
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
