"""Running sweeps against one or more targets: same workload, server metrics per level, live progress."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

from surge.bench import metrics as prom
from surge.bench.loadgen import LoadSpec, RunResult, run_load
from surge.bench.progress import LiveProgress
from surge.bench.targets import RequestFailed
from surge.bench.workloads import Workload


class TargetUnavailable(Exception):
    """A target failed the one request sent before the sweep: nothing it would measure would mean anything."""

    def __init__(self, name: str, failure: RequestFailed):
        super().__init__(f"{name}: {failure}")
        self.name = name
        self.failure = failure


async def preflight(name: str, make_target: Callable[[], object], text: str) -> None:
    """Send one request (unmeasured) to `name`; raise TargetUnavailable when it fails, so that a server that
    is down, or a wrong URL or protocol, is one clear error at once rather than a sweep of failures."""
    target = make_target()
    try:
        await target.open(1)
        await target.send([text])
    except RequestFailed as exc:
        raise TargetUnavailable(name, exc) from None
    finally:
        await target.close()


async def run_sweep(make_target: Callable[[], object], workload: Workload, specs: list[LoadSpec], *,
                    name: str = "target", metrics_url: str | None = None, metrics_api_key: str | None = None,
                    progress: LiveProgress | None = None, halt: asyncio.Event | None = None) -> list[RunResult]:
    """One run per spec. Each level draws its own seeded query stream, so a level repeats exactly
    and two targets benchmarked with the same specs see the same queries. The server's counters are
    read when the warm-up ends and after the run, so its cache and batch statistics cover the measured
    requests (and at most those in flight at the boundary), not the warm-up's. Once `halt` is set the
    level under way stops early (marked `interrupted`) and no further level starts."""
    results = []
    for spec in specs:
        if halt is not None and halt.is_set():
            break
        queries = workload.stream(seed=workload.seed * 1_000_003 + spec.seed)
        before: dict = {}

        async def mark(before=before):
            before["m"] = await prom.scrape(metrics_url, api_key=metrics_api_key)

        cb = progress.callback(spec, name) if progress is not None else None
        r = await run_load(make_target(), queries, spec, times=workload.times, on_progress=cb,
                           at_measure_start=mark if metrics_url else None, halt=halt)
        # No reading at the start (unreachable then): no deltas, rather than the server's lifetime totals.
        r.metrics = (prom.delta(before["m"], await prom.scrape(metrics_url, api_key=metrics_api_key))
                     if before.get("m") else {})
        r.target = name
        results.append(r)
    return results


async def run_many(targets: dict[str, tuple[Callable[[], object], str | None]], workload: Workload,
                   specs: list[LoadSpec], *, show_progress: bool = True,
                   stop_on_sigint: bool = False, check_first: bool = False,
                   metrics_api_key: str | None = None) -> dict[str, list[RunResult]]:
    """`targets`: name -> (target factory, metrics URL or None); run one after another.

    `check_first`: every target answers one request (`preflight`) before any load is sent.

    `metrics_api_key`: the bearer token the metrics URLs are read with.

    `stop_on_sigint`: the first Ctrl-C stops the level under way as its clock would (what it measured is
    kept, marked `interrupted`) and skips the rest; a second one aborts at once (KeyboardInterrupt)."""
    out: dict[str, list[RunResult]] = {}
    halt = asyncio.Event()
    loop = asyncio.get_running_loop()
    if stop_on_sigint:
        def first_interrupt():
            halt.set()
            loop.remove_signal_handler(signal.SIGINT)  # back to the default: the next Ctrl-C aborts

        loop.add_signal_handler(signal.SIGINT, first_interrupt)
    try:
        if check_first:
            for name, (factory, _) in targets.items():
                await preflight(name, factory, workload.queries[0])
        with LiveProgress(enabled=show_progress) as progress:
            for name, (factory, murl) in targets.items():
                if halt.is_set():
                    break
                out[name] = await run_sweep(factory, workload, specs, name=name, metrics_url=murl,
                                            metrics_api_key=metrics_api_key, progress=progress, halt=halt)
    finally:
        if stop_on_sigint:
            loop.remove_signal_handler(signal.SIGINT)
    return out
