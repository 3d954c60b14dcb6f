"""surge against the hand-written baseline (FastAPI + transformers, one request at a time), one run.

Starts both servers as processes on free ports, drives each with the same
closed-loop workload (template queries, Zipf popularity, fixed seed) at each
client count, one server at a time, then prints a table (throughput, p50/p99,
speed-up, p99 ratio), writes JSON and PNG plots, and stops both servers.

    PYTHONPATH=src python benchmarks/serving_vs_baseline.py --clients 1,16,64 --duration 10 \
        --plots docs/img --json docs/benchmarks/bench.json --markdown /tmp/bench_table.md

`--surge-flag` passes a flag to `surge serve` (repeatable), e.g. --surge-flag=--no-batching.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,16,64", help="closed-loop client counts")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per level")
    p.add_argument("--requests", type=int, default=0, help="most measured requests per level (0: no bound)")
    p.add_argument("--protocol", default="native", choices=["native", "openai"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent (default: top 500 = 30%% of traffic)")
    p.add_argument("--threads", type=int, default=0, help="surge serve --threads (0: all cores)")
    p.add_argument("--baseline-threads", type=int, default=1,
                   help="torch threads of the baseline (default 1: on 2 shared cores a 2-thread OpenMP team "
                        "stalls whenever one thread is preempted, which made the baseline ~10x slower; 0: torch's default)")
    p.add_argument("--surge-flag", action="append", default=[], help="extra `surge serve` flag (repeatable)")
    p.add_argument("--surge-src", type=Path, default=None,
                   help="serve surge from this src/ directory (e.g. another branch's worktree) instead of this one's")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plots", type=Path, default=None, help="directory for bench_*.png")
    p.add_argument("--markdown", type=Path, default=None, help="write the comparison table here too")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()

    sys.path.insert(0, str(ROOT / "src"))
    from rich.console import Console

    from surge.bench import plots as P
    from surge.bench.loadgen import LoadSpec, sweep_specs
    from surge.bench.report import comparison_markdown, summarize, table, write_json
    from surge.bench.runner import run_many
    from surge.bench.servers import ServerProc, free_port, surge_serve_argv
    from surge.bench.targets import make_target
    from surge.bench.workloads import make_workload
    from surge.bench.cli_helpers import run_coro as _run

    console = Console(stderr=True)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    bport, sport = free_port(), free_port()
    base_argv = [sys.executable, str(HERE / "baselines" / "fastapi_transformers.py"), "--port", str(bport)]
    surge_flags = list(args.surge_flag)
    if args.baseline_threads:
        base_argv += ["--threads", str(args.baseline_threads)]
    if args.threads:
        surge_flags += ["--threads", str(args.threads)]
    surge_env = dict(env)
    if args.surge_src:
        # Another checkout's code, read only: no bytecode written into it.
        surge_env.update(PYTHONPATH=os.pathsep.join([str(args.surge_src.resolve()), env["PYTHONPATH"]]),
                         PYTHONDONTWRITEBYTECODE="1")
    servers = [ServerProc("baseline", base_argv, bport, env=env, cwd=ROOT),
               ServerProc("surge", surge_serve_argv(sport, *surge_flags), sport, env=surge_env, cwd=ROOT)]
    workload = make_workload(zipf_s=args.zipf, seed=args.seed)
    clients = [int(c) for c in args.clients.split(",")]
    specs = sweep_specs(LoadSpec(mode="closed", duration_s=args.duration, warmup_s=args.warmup,
                                 max_requests=args.requests or None, seed=args.seed), clients)
    load_before = os.getloadavg()
    try:
        with console.status("[bold]starting servers[/]") as status:
            for s in servers:  # both load at once; they are benchmarked one at a time
                s.start(wait=False)
            for s in servers:
                s.wait_ready(status)
        targets = {s.name: ((lambda s=s: make_target(args.protocol, s.url, None, args.timeout)), s.url)
                   for s in servers}
        runs = _run(run_many(targets, workload, specs, show_progress=not args.no_progress))
    finally:
        for s in servers:
            s.stop()
    load_after = os.getloadavg()

    out = Console()
    out.print(table(runs, title="baseline (FastAPI + transformers) vs surge"))
    md = comparison_markdown(runs["baseline"], runs["surge"], "baseline", "surge")
    print(md)
    note = (f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, "
            f"after {tuple(round(x, 2) for x in load_after)}; surge flags: {' '.join(surge_flags) or '(defaults)'}; "
            f"surge code: {args.surge_src or ROOT / 'src'}; "
            f"baseline torch threads: {args.baseline_threads or 'default'}")
    print(note)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md + "\n\n" + note + "\n")
    if args.json:
        write_json(args.json, runs, {"workload": workload.describe(), "surge_flags": surge_flags,
                                     "loadavg_before": load_before, "loadavg_after": load_after})
    if args.plots:
        for path in P.write_all(runs, args.plots, prefix="bench", workload=workload):
            print(f"plot: {path}")
    failed = sum(summarize(r)["error_count"] for rs in runs.values() for r in rs)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
