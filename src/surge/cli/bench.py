"""`surge bench`: load-test any embedding server (or an engine in this process) and report.

    surge bench run http://127.0.0.1:8000 --concurrency 1,16,64 --duration 10 --json out.json --plots img/
    surge bench run http://127.0.0.1:8000 --mode open --rate 50,100,200 -c 64
    surge bench run 127.0.0.1:8001 --protocol kserve-grpc --model all-MiniLM-L6-v2
    surge bench run in-process --concurrency 16
    surge bench compare --target base=http://127.0.0.1:9000 --target surge=http://127.0.0.1:8000
    surge bench workload log.jsonl --requests 10000 --rate 100
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

bench_app = typer.Typer(help="Benchmark embedding servers: closed/open loop, sweeps, reports and plots.",
                        no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


def _levels(text: str, cast, hint: str) -> list:
    try:
        levels = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels:
        raise typer.BadParameter(f"expected a comma-separated list of numbers, got {text!r}",
                                 param_hint=hint) from None
    return levels


def _positive(value: float, hint: str) -> None:
    if not value > 0:
        raise typer.BadParameter(f"must be > 0, got {value:g}", param_hint=hint)


def _workload(query_log: Optional[Path], queries: int, zipf: Optional[float], seed: int):
    from surge.bench.workloads import make_workload, read_query_log

    if query_log is not None:
        try:
            return read_query_log(query_log)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--query-log") from None
    return make_workload(queries, zipf, seed)


def _open_loop_limits(concurrency: Optional[str], connections: Optional[int],
                      max_inflight: Optional[int]) -> tuple[int, int]:
    """(connections, most in flight) of an open loop or replay. `-c` there is the cap on requests in flight
    (k6's maxVUs, vegeta's -max-workers, wrk2's -c): one number, not a sweep (the rate sweeps); the pool
    gets as many connections, so that no request under the cap waits for one."""
    from surge.bench.loadgen import LoadSpec

    cap = LoadSpec.max_inflight  # no cap (a bound on the generator's own memory)
    if concurrency is not None:
        levels = _levels(concurrency, int, "--concurrency")
        if len(levels) != 1:
            raise typer.BadParameter("in open loop and replay -c is one cap on the requests in flight, not a "
                                     "sweep (--rate sweeps)", param_hint="--concurrency")
        if max_inflight is not None and max_inflight != levels[0]:
            raise typer.BadParameter("--max-inflight is the old name of -c in open loop: give one of them",
                                     param_hint="--max-inflight")
        cap = levels[0]
    elif max_inflight is not None:
        cap = max_inflight
    if cap < 1:
        raise typer.BadParameter(f"must be >= 1, got {cap}", param_hint="--concurrency")
    if connections is None:
        connections = cap if cap < LoadSpec.max_inflight else _POOL
    return connections, cap


_POOL = 256  # open loop without a cap: connections to the target (arrivals beyond wait for one)


def _specs(mode, concurrency, rate, duration, warmup, requests, inputs, seed, max_inflight, replay_speed,
           connections=None):
    from surge.bench.loadgen import LoadSpec, sweep_specs

    if mode == "closed":
        conc = _levels("16" if concurrency is None else concurrency, int, "--concurrency")
        cap = LoadSpec.max_inflight
    else:
        pool, cap = _open_loop_limits(concurrency, connections, max_inflight)
        conc = [pool]
    base = LoadSpec(mode=mode, concurrency=conc[0], duration_s=duration, warmup_s=warmup,
                    max_requests=requests or None, inputs_per_request=inputs, seed=seed, max_inflight=cap,
                    replay_speed=replay_speed)
    if mode == "open":
        if not rate:
            raise typer.BadParameter("open loop needs --rate", param_hint="--rate")
        specs = sweep_specs(base, _levels(rate, float, "--rate"))
    elif mode == "closed":
        specs = sweep_specs(base, conc)
    else:
        specs = [base]
    try:
        for s in specs:
            s.validate()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return specs


def _report(runs, workload, json_out, plots, prefix, title):
    from rich.console import Console

    from surge.bench import plots as P
    from surge.bench.report import failure_report, table, write_json

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))  # a log or a pipe: the whole table, not 80 columns of it
    console.print(table(runs, title=title))
    if json_out:
        path = write_json(json_out, runs, {"workload": workload.describe()})
        console.print(f"JSON: {path}")
    if plots:
        for p in P.write_all(runs, plots, prefix=prefix, workload=workload):
            console.print(f"plot: {p}")
    # Per level: how many failed (overload answers apart) or were dropped, and each kind's first messages.
    for line in failure_report(runs):
        console.print(line, markup=False, highlight=False)


def _check_failures(runs, max_error_rate: float) -> None:
    """Exit 1 when a level's failed-or-dropped fraction is over `max_error_rate` (default 0: any failure),
    so that a CI step running the benchmark fails with the server. A level, not the sweep's total: one
    level failing 20 % is not hidden by clean ones."""
    from surge.bench.report import failed_fraction, summarize

    over = [(name, s) for name, rs in runs.items() for s in map(summarize, rs)
            if failed_fraction(s) > max_error_rate]
    if not over:
        return
    worst = ", ".join(f"{name} · {s['label']}: {failed_fraction(s):.1%}" for name, s in over)
    typer.echo(f"error: requests failed or were dropped beyond --max-error-rate {max_error_rate:g} ({worst}); "
               "overload answers (429/503) and dropped arrivals count too", err=True)
    raise typer.Exit(code=1)


def _execute(named, workload, specs, progress, metrics_api_key=None):
    """Run the sweep; a target that fails its first request, or a bad target, is a clear error (exit 1 / 2).
    Ctrl-C stops it early: the caller reports what was measured, then exits 130."""
    from surge.bench.runner import TargetUnavailable, run_many

    try:
        return _run(run_many(named, workload, specs, show_progress=progress, stop_on_sigint=True, check_first=True,
                             metrics_api_key=metrics_api_key))
    except TargetUnavailable as exc:
        typer.echo(f"error: {exc}\n(nothing was measured: the target did not answer one request; is it running, "
                   "and are the URL and --protocol right?)", err=True)
        raise typer.Exit(code=1) from None
    except ValueError as exc:  # e.g. a KServe target whose model could not be found
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None


def _interrupted(runs) -> bool:
    if any(r.interrupted for rs in runs.values() for r in rs):
        typer.echo("interrupted (Ctrl-C): the table holds what was measured until then", err=True)
        return True
    return False


def _in_process_factory(model_dir: Optional[Path], threads: int, cache_dir: Optional[Path]):
    """Build surge's ModelService here (no HTTP); shared by every run of the sweep."""
    from surge.cli.bootstrap import load_service
    from surge.config import EngineConfig, ServerConfig
    from surge.models import bundled_model_dir, load_model_spec

    config = ServerConfig(model_dir=model_dir, cache_dir=cache_dir, engine=EngineConfig(threads=threads))
    spec = load_model_spec(model_dir or bundled_model_dir())
    service = load_service(config, spec)
    service.mark_ready()
    from surge.bench.targets import InProcess

    return service, (lambda: InProcess(service, name=f"in-process:{spec.name}"))


@bench_app.command("run")
def run(
    target: str = typer.Argument(..., help="Base URL (http://host:port), host:port for gRPC, or 'in-process'."),
    protocol: str = typer.Option("native", "--protocol", "-p", help="native (/embed), openai (/v1/embeddings), kserve (HTTP v2), kserve-grpc."),
    model: Optional[str] = typer.Option(None, help="Model name (OpenAI 'model', KServe model; default: the server's first)."),
    mode: str = typer.Option("closed", help="closed (N clients), open (Poisson arrivals) or replay (a log's times)."),
    concurrency: Optional[str] = typer.Option(
        None, "--concurrency", "-c",
        help="Closed loop: clients (a list sweeps; default 16). Open loop/replay: most requests in flight (one "
             "number, like k6's maxVUs or vegeta's -max-workers): an arrival that finds that many in flight is "
             "not sent, and is reported as dropped (never queued, so the asked rate is either offered or the "
             "shortfall is shown); default: no cap."),
    connections: Optional[int] = typer.Option(
        None, min=1, help="Open loop/replay: most connections to the target (default: -c, or 256 without it; "
                          "arrivals beyond wait for one, and that wait counts as latency)."),
    rate: Optional[str] = typer.Option(None, "--rate", "-r", help="Arrivals per second (open loop; a list sweeps)."),
    duration: float = typer.Option(10.0, "--duration", "-d", help="Measured seconds per level."),
    warmup: float = typer.Option(2.0, min=0.0, help="Seconds of unmeasured warm-up per level."),
    requests: int = typer.Option(0, "--requests", "-n", min=0, help="Most measured requests per level (0: no bound)."),
    inputs: int = typer.Option(1, help="Inputs (texts) per request."),
    queries: int = typer.Option(6000, min=1, help="Distinct template queries in the pool."),
    zipf: Optional[float] = typer.Option(None, help="Zipf exponent of query popularity (default: top 500 = 30% of traffic)."),
    seed: int = typer.Option(0, help="Seed of queries, popularity and arrivals."),
    query_log: Optional[Path] = typer.Option(None, help="Replay this query log (JSON lines or one query per line) instead of templates."),
    replay_speed: float = typer.Option(1.0, help="Replay: time compression of the log's arrival times."),
    timeout: float = typer.Option(30.0, help="Per-request timeout (s)."),
    max_inflight: Optional[int] = typer.Option(None, min=1, hidden=True, help="Old name of -c in open loop."),
    max_error_rate: float = typer.Option(
        0.0, min=0.0, max=1.0,
        help="Exit 1 when, at any level, more than this fraction of the measured requests failed (non-2xx, "
             "transport error, timeout, wrong answer; overload answers 429/503 included) or were dropped "
             "(open loop: -c in flight). Default 0: any failure fails the run."),
    metrics_url: Optional[str] = typer.Option(None, help="Prometheus /metrics to read cache and batch statistics from (default: the target's, HTTP only)."),
    api_key: Optional[str] = typer.Option(None, envvar="SURGE_API_KEY", help="Bearer token for the target."),
    model_dir: Optional[Path] = typer.Option(None, help="in-process: model directory (default: bundled)."),
    threads: int = typer.Option(0, help="in-process: ONNX Runtime threads (0: all cores)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write a JSON report here."),
    plots: Optional[Path] = typer.Option(None, help="Write PNG plots into this directory."),
    name: Optional[str] = typer.Option(None, help="Name of the target in reports."),
    progress: bool = typer.Option(True, help="Live progress display."),
) -> None:
    """Benchmark one target: closed-loop clients or open-loop Poisson arrivals, over a sweep."""
    from surge.bench.targets import make_target

    _positive(timeout, "--timeout")
    _positive(replay_speed, "--replay-speed")
    workload = _workload(query_log, queries, zipf, seed)
    specs = _specs(mode, concurrency, rate, duration, warmup, requests, inputs, seed, max_inflight, replay_speed,
                   connections)
    service = None
    if target in ("in-process", "inproc"):
        service, factory = _in_process_factory(model_dir, threads, None)
        murl = None
    else:
        try:
            make_target(protocol, target, model, timeout, api_key)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--protocol") from None
        factory = lambda: make_target(protocol, target, model, timeout, api_key)  # noqa: E731
        murl = metrics_url or (target if protocol != "kserve-grpc" else None)
    label = name or (target if service is None else "in-process")
    try:
        runs = _execute({label: (factory, murl)}, workload, specs, progress, metrics_api_key=api_key)
    finally:
        if service is not None:
            _run(service.close())
    _report(runs, workload, json_out, plots, "bench", f"surge bench · {label}")
    if _interrupted(runs):
        raise typer.Exit(code=130)
    _check_failures(runs, max_error_rate)


def _run(coro):
    from surge.bench.cli_helpers import run_coro

    return run_coro(coro)


@bench_app.command("compare")
def compare(
    targets: list[str] = typer.Option(..., "--target", "-t", help="NAME=URL (repeat); the first is the baseline."),
    protocol: str = typer.Option("native", "--protocol", "-p", help="Protocol spoken by every target."),
    model: Optional[str] = typer.Option(None, help="Model name."),
    concurrency: str = typer.Option("1,16,64", "--concurrency", "-c", help="Closed-loop client counts."),
    duration: float = typer.Option(10.0, "--duration", "-d"),
    warmup: float = typer.Option(2.0, min=0.0),
    requests: int = typer.Option(0, "--requests", "-n", min=0),
    queries: int = typer.Option(6000, min=1),
    zipf: Optional[float] = typer.Option(None),
    seed: int = typer.Option(0),
    timeout: float = typer.Option(60.0),
    max_error_rate: float = typer.Option(
        0.0, min=0.0, max=1.0,
        help="Exit 1 when, at any level of any target, more than this fraction of the measured requests "
             "failed (overload answers 429/503 included). Default 0: any failure fails the run."),
    api_key: Optional[str] = typer.Option(None, envvar="SURGE_API_KEY",
                                          help="Bearer token for every target (and their /metrics)."),
    json_out: Optional[Path] = typer.Option(None, "--json"),
    plots: Optional[Path] = typer.Option(None),
    progress: bool = typer.Option(True),
) -> None:
    """Run the same workload against several running servers, one after another; print a comparison."""
    from surge.bench.report import comparison_markdown
    from surge.bench.targets import make_target

    named = {}
    for t in targets:
        if "=" not in t:
            raise typer.BadParameter(f"expected NAME=URL, got {t!r}", param_hint="--target")
        n, url = t.split("=", 1)
        if n in named:  # a second NAME would silently replace the first target's runs
            raise typer.BadParameter(f"target name {n!r} given twice", param_hint="--target")
        named[n] = ((lambda url=url: make_target(protocol, url, model, timeout, api_key)),
                    url if protocol != "kserve-grpc" else None)
    if len(named) < 2:
        raise typer.BadParameter("compare needs two targets or more (one: `surge bench run`)", param_hint="--target")
    _positive(timeout, "--timeout")
    workload = _workload(None, queries, zipf, seed)
    specs = _specs("closed", concurrency, None, duration, warmup, requests, 1, seed, 10000, 1.0)
    runs = _execute(named, workload, specs, progress, metrics_api_key=api_key)
    _report(runs, workload, json_out, plots, "bench_compare", "surge bench compare")
    names = list(runs)
    for other in names[1:]:
        typer.echo(comparison_markdown(runs[names[0]], runs[other], names[0], other))
    if _interrupted(runs):
        raise typer.Exit(code=130)
    _check_failures(runs, max_error_rate)


@bench_app.command("workload")
def workload(
    out: Path = typer.Argument(..., help="Query log to write: JSON lines (text, t), or one query per line for a .txt path."),
    requests: int = typer.Option(10000, "--requests", "-n", help="Requests in the log."),
    rate: float = typer.Option(0.0, help="Add Poisson arrival times at this rate (0: no times)."),
    queries: int = typer.Option(6000, help="Distinct template queries in the pool."),
    zipf: Optional[float] = typer.Option(None, help="Zipf exponent (default: top 500 = 30% of traffic)."),
    seed: int = typer.Option(0),
) -> None:
    """Write a replayable query log drawn from the template workload."""
    from surge.bench.workloads import make_workload, poisson_offsets, write_query_log

    w = make_workload(queries, zipf, seed)
    texts = w.sample(requests, seed)
    times = poisson_offsets(requests, rate, seed) if rate > 0 else None
    write_query_log(out, texts, times)
    d = w.describe()
    typer.echo(f"wrote {requests} requests over {d['distinct_queries']} queries (Zipf s={d['zipf_s']:.3f}, "
               f"top 500 = {d['top500_share']:.0%}) to {out}")
