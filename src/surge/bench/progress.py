"""Live progress of a run (rich): elapsed time against the planned time, rate, errors, latency."""

from __future__ import annotations

import numpy as np

from surge.bench.loadgen import LoadSpec, Recorder


class LiveProgress:
    """`with LiveProgress() as p: await run_load(..., on_progress=p.callback(spec, "surge"))`."""

    def __init__(self, console=None, enabled: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[stats]}"), console=self.console,
                                 refresh_per_second=4, disable=not enabled, transient=False)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def callback(self, spec: LoadSpec, name: str):
        total = spec.warmup_s + spec.duration_s
        task = self.progress.add_task(f"{name} · {spec.label()}", total=total, stats="warming up")
        state = {"n": 0, "t": 0.0, "rate": 0.0}

        def update(rec: Recorder, elapsed: float) -> None:
            n = len(rec.end)
            dt = elapsed - state["t"]
            if dt >= 0.2:
                state["rate"] = 0.7 * state["rate"] + 0.3 * (n - state["n"]) / dt if state["n"] else (n - state["n"]) / dt
                state["n"], state["t"] = n, elapsed
            errors = rec.errors
            recent = rec.end[-200:]
            recent_s = rec.sched[-200:]
            p50 = float(np.median(np.subtract(recent, recent_s[: len(recent)]))) * 1000 if recent else 0.0
            stats = (f"{n} done · {state['rate']:.0f} req/s · p50 {p50:.1f} ms · in flight {rec.inflight}"
                     + (f" · [red]{errors} errors[/]" if errors else "")
                     + (f" · [yellow]{rec.dropped} dropped[/]" if rec.dropped else ""))
            self.progress.update(task, completed=min(elapsed, total), stats=stats)

        return update
