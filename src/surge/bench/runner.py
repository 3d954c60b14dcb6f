"""Running sweeps against one or more targets: same workload, server metrics per level, live progress."""

from __future__ import annotations

from typing import Callable

from surge.bench import metrics as prom
from surge.bench.loadgen import LoadSpec, RunResult, run_load
from surge.bench.progress import LiveProgress
from surge.bench.workloads import Workload


async def run_sweep(make_target: Callable[[], object], workload: Workload, specs: list[LoadSpec], *,
                    name: str = "target", metrics_url: str | None = None,
                    progress: LiveProgress | None = None) -> list[RunResult]:
    """One run per spec. Each level draws its own seeded query stream, so a level repeats exactly
    and two targets benchmarked with the same specs see the same queries."""
    results = []
    for spec in specs:
        queries = workload.stream(seed=workload.seed * 1_000_003 + spec.seed)
        before = await prom.scrape(metrics_url)
        cb = progress.callback(spec, name) if progress is not None else None
        r = await run_load(make_target(), queries, spec, times=workload.times, on_progress=cb)
        r.metrics = prom.delta(before, await prom.scrape(metrics_url))
        r.target = name
        results.append(r)
    return results


async def run_many(targets: dict[str, tuple[Callable[[], object], str | None]], workload: Workload,
                   specs: list[LoadSpec], *, show_progress: bool = True) -> dict[str, list[RunResult]]:
    """`targets`: name -> (target factory, metrics URL or None); run one after another."""
    out: dict[str, list[RunResult]] = {}
    with LiveProgress(enabled=show_progress) as progress:
        for name, (factory, murl) in targets.items():
            out[name] = await run_sweep(factory, workload, specs, name=name, metrics_url=murl, progress=progress)
    return out
