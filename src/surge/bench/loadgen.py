"""Load generation: closed loop, open loop (Poisson) and log replay, with warm-up and bounds.

Closed loop: `concurrency` clients, each sending its next request as soon as the
previous one is answered (throughput at a fixed number of users).

Open loop: arrivals of a Poisson process at `rate` per second, sent whether or
not earlier ones were answered. Latency is measured from each request's
*scheduled* send time, so time spent waiting for a connection, or for the
generator itself, counts: queueing is never hidden (no coordinated omission).
`max_inflight` caps the requests in flight, as k6's maxVUs and vegeta's
-max-workers do: an arrival that finds that many in flight is not sent and is
recorded as `DROPPED` (k6's dropped_iterations), never queued behind them, so a
capped run says how much of the asked rate it could not offer.

Requests scheduled during the first `warmup_s` seconds are sent but not
measured. A run stops issuing after `duration_s` seconds of measurement or
`max_requests` measured requests, whichever comes first (or when `stop` is set:
Ctrl-C), then waits for what is in flight (each request is bounded by the
target's timeout).

Throughput of a run stopped by the clock (or by `stop`) is the successful
completions inside the measurement window divided by its length: counting the
requests *issued* in the window over "window start -> last completion" would
add the drain after it (requests issued just before the end) and miss the
warm-up answers that arrive in it, under-counting by (D + L/2) / (D + L) for
latency L. A run stopped by its request count keeps that makespan definition.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable, Iterator

import numpy as np

from surge.bench.targets import RequestFailed

now = time.perf_counter

# The kind of an open-loop arrival that found `max_inflight` requests in flight: scheduled, never sent.
DROPPED = "dropped"
# Distinct failure messages kept per kind (the first ones): enough to tell "boom A" from "boom B".
MESSAGES_PER_KIND = 3


@dataclass
class LoadSpec:
    mode: str = "closed"  # closed | open | replay
    concurrency: int = 16  # closed: clients; open/replay: connections to the target
    rate: float = 0.0  # open: mean arrivals per second
    duration_s: float = 10.0  # measured seconds (after warm-up)
    max_requests: int | None = None  # measured requests, at most
    warmup_s: float = 1.0
    inputs_per_request: int = 1
    seed: int = 0
    max_inflight: int = 10_000  # open loop/replay: arrivals finding this many in flight are `DROPPED`
    replay_speed: float = 1.0  # replay: >1 compresses the log's time axis

    def validate(self) -> "LoadSpec":
        if self.mode not in ("closed", "open", "replay"):
            raise ValueError(f"mode must be closed, open or replay, not {self.mode!r}")
        if self.mode == "open" and self.rate <= 0:
            raise ValueError("open loop needs a rate > 0")
        if self.concurrency < 1 or self.inputs_per_request < 1 or self.max_inflight < 1:
            raise ValueError("concurrency, max_inflight and inputs_per_request must be >= 1")
        if self.duration_s <= 0 and not self.max_requests:
            raise ValueError("bound the run: duration_s > 0 or max_requests")
        return self

    @property
    def level(self) -> float:
        return self.rate if self.mode == "open" else self.concurrency

    def label(self) -> str:
        return f"{self.rate:g} req/s" if self.mode == "open" else f"{self.concurrency} clients"


class Recorder:
    """Per-request timings (perf_counter seconds) kept in flat lists: cheap to append."""

    def __init__(self):
        self.sched: list[float] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.kind: list[str | None] = []
        self.measured: list[bool] = []
        self.inflight = 0
        self.errors = 0  # failed requests (dropped arrivals apart: never sent)
        self.dropped = 0
        self.details: dict[str, list[str]] = {}  # the first distinct failure messages, per kind
        # When issuing stopped by the clock or by `stop` (perf_counter); None when by count or a log's end.
        self.window_end: float | None = None

    def add(self, sched: float, start: float, end: float, kind: str | None, measured: bool) -> None:
        self.sched.append(sched)
        self.start.append(start)
        self.end.append(end)
        self.kind.append(kind)
        self.measured.append(measured)
        if kind == DROPPED:
            self.dropped += 1
        elif kind is not None:
            self.errors += 1

    def note(self, kind: str, message: str) -> None:
        seen = self.details.setdefault(kind, [])
        if len(seen) < MESSAGES_PER_KIND and message not in seen:
            seen.append(message)


@dataclass
class RunResult:
    """Measured requests of one run (warm-up dropped)."""

    spec: LoadSpec
    target: str
    scheduled: np.ndarray  # seconds since measurement start
    started: np.ndarray
    latency: np.ndarray  # end - scheduled, seconds (failed requests too)
    ok: np.ndarray  # bool
    kinds: list[str | None]
    window_s: float  # measurement start -> last measured completion
    inputs_per_request: int
    warmup_requests: int
    metrics: dict = field(default_factory=dict)  # server-side deltas (bench/metrics.py)
    # Successful completions (warm-up requests' too) inside the window [0, window_s], when the window was
    # closed by the clock: throughput's numerator. None: the run was bounded by count (see the module doc).
    completed_in_window: int | None = None
    error_examples: dict[str, str] = field(default_factory=dict)  # kind -> the first such failure's message
    error_messages: dict[str, list[str]] = field(default_factory=dict)  # kind -> its first distinct messages
    interrupted: bool = False  # cut short by `stop` (Ctrl-C)
    # The generator's own CPU (this process, warm-up included) and the run's wall time: on a machine it
    # shares with the server under test, what the generator burns the server does not get.
    generator_cpu_s: float = 0.0
    generator_wall_s: float = 0.0

    @property
    def errors(self) -> dict[str, int]:
        """Failed requests by kind, most frequent first (dropped arrivals apart: they were never sent)."""
        out: dict[str, int] = {}
        for k in self.kinds:
            if k is not None and k != DROPPED:
                out[k] = out.get(k, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def dropped(self) -> int:
        """Measured arrivals not sent: they found `spec.max_inflight` in flight (open loop/replay)."""
        return sum(k == DROPPED for k in self.kinds)

    @property
    def count(self) -> int:
        """Measured requests scheduled: succeeded + failed + dropped."""
        return int(self.ok.shape[0])


def _result(rec: Recorder, spec: LoadSpec, target: str, t_measure: float) -> RunResult:
    m = np.asarray(rec.measured, dtype=bool)
    sched = np.asarray(rec.sched)[m]
    start = np.asarray(rec.start)[m]
    end = np.asarray(rec.end)[m]
    kinds = [k for k, keep in zip(rec.kind, rec.measured) if keep]
    done_in_window = None
    if rec.window_end is not None and rec.window_end > t_measure:
        window = rec.window_end - t_measure
        all_end = np.asarray(rec.end)
        all_ok = np.array([k is None for k in rec.kind], dtype=bool)
        done_in_window = int((all_ok & (all_end >= t_measure) & (all_end <= rec.window_end)).sum())
    else:
        window = float(end.max() - t_measure) if end.size else 0.0
    return RunResult(spec, target, sched - t_measure, start - t_measure, end - sched,
                     np.array([k is None for k in kinds], dtype=bool), kinds, window,
                     spec.inputs_per_request, int((~m).sum()), completed_in_window=done_in_window,
                     error_examples={k: rec.details[k][0] for k in set(kinds) if k in rec.details},
                     error_messages={k: list(rec.details[k]) for k in set(kinds) if k in rec.details})


async def _one(target, texts: list[str], sched: float, rec: Recorder, measured: bool) -> None:
    """Send one request and record it. The caller has counted it in `rec.inflight` already: the open loop
    must count a request when it creates its task, not when the task first runs, or a burst of overdue
    arrivals (created with no await between them) would all pass the `max_inflight` check."""
    start = now()
    kind = None
    try:
        await target.send(texts)
    except RequestFailed as exc:
        kind = exc.kind
        rec.note(kind, str(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a client-side bug still shows up as an error kind
        kind = f"exception_{type(exc).__name__}"
        rec.note(kind, str(exc))
    finally:
        rec.inflight -= 1
    rec.add(sched, start, now(), kind, measured)


def _batches(queries: Iterator[str], k: int) -> Iterator[list[str]]:
    while True:
        yield [next(queries) for _ in range(k)]


def _close_window(rec: Recorder, t: float) -> None:
    if rec.window_end is None:
        rec.window_end = t


async def closed_loop(target, queries: Iterator[str], spec: LoadSpec, rec: Recorder,
                      t0: float | None = None, halt: asyncio.Event | None = None) -> float:
    batches = _batches(queries, spec.inputs_per_request)
    t0 = now() if t0 is None else t0
    warm_end = t0 + spec.warmup_s
    stop = warm_end + spec.duration_s if spec.duration_s > 0 else float("inf")
    issued = 0
    by_count = False

    async def client():
        nonlocal issued, by_count
        while True:
            t = now()
            if halt is not None and halt.is_set():
                _close_window(rec, max(t, warm_end))
                return
            if t >= stop:
                if not by_count:
                    _close_window(rec, stop)
                return
            measured = t >= warm_end
            if measured:
                if spec.max_requests and issued >= spec.max_requests:
                    return
                issued += 1
                by_count = by_count or issued == spec.max_requests
            rec.inflight += 1
            await _one(target, next(batches), t, rec, measured)

    await asyncio.gather(*(client() for _ in range(spec.concurrency)))
    return warm_end


async def open_loop(target, queries: Iterator[str], spec: LoadSpec, rec: Recorder,
                    offsets: Iterator[float], t0: float | None = None, halt: asyncio.Event | None = None) -> float:
    """Send at t0 + offset for each offset (Poisson or a log's times); latency from that instant."""
    batches = _batches(queries, spec.inputs_per_request)
    loop = asyncio.get_running_loop()
    t0 = now() if t0 is None else t0
    warm_end = t0 + spec.warmup_s
    stop = warm_end + spec.duration_s if spec.duration_s > 0 else float("inf")
    tasks: set[asyncio.Task] = set()
    issued = 0
    for off in offsets:
        sched = t0 + off
        if sched >= stop:
            _close_window(rec, stop)
            break
        measured = sched >= warm_end
        if measured:
            if spec.max_requests and issued >= spec.max_requests:
                break
            issued += 1
        delay = sched - now()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        if halt is not None and halt.is_set():
            _close_window(rec, max(now(), warm_end))
            break
        if rec.inflight >= spec.max_inflight:  # not sent, and not queued either: counted as dropped
            t = now()
            rec.add(sched, t, t, DROPPED, measured)
            continue
        rec.inflight += 1
        task = loop.create_task(_one(target, next(batches), sched, rec, measured))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return warm_end


def poisson_stream(rate: float, seed: int) -> Iterator[float]:
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        for gap in rng.exponential(1.0 / rate, size=4096):
            t += gap
            yield t


async def run_load(target, queries: Iterator[str], spec: LoadSpec, *, times: np.ndarray | None = None,
                   on_progress: Callable[[Recorder, float], None] | None = None,
                   connections: int | None = None,
                   at_measure_start: Callable[[], Awaitable[object]] | None = None,
                   halt: asyncio.Event | None = None) -> RunResult:
    """One run against an opened-or-not target; the target is opened and closed here.

    `at_measure_start` is awaited when the warm-up ends (as the load goes on), e.g. to read the server's
    counters so that its statistics cover the measured requests only. `halt`, once set, stops issuing
    as the clock would (Ctrl-C): what was measured is returned, marked `interrupted`."""
    spec.validate()
    rec = Recorder()
    ticker = None
    marker = None
    cpu0, wall0 = time.process_time(), now()
    try:
        await target.open(connections or spec.concurrency)
        if on_progress is not None:
            t_start = now()

            async def tick():
                while True:
                    on_progress(rec, now() - t_start)
                    await asyncio.sleep(0.25)

            ticker = asyncio.create_task(tick())
        if spec.mode == "replay" and times is None:
            raise ValueError("replay needs a query log with times ('t')")
        t0 = now()
        if at_measure_start is not None:
            if spec.warmup_s <= 0:
                await at_measure_start()
                t0 = now()
            else:
                async def mark():
                    await asyncio.sleep(max(0.0, t0 + spec.warmup_s - now()))
                    await at_measure_start()

                marker = asyncio.create_task(mark())
        if spec.mode == "closed":
            t_measure = await closed_loop(target, queries, spec, rec, t0, halt)
        elif spec.mode == "open":
            t_measure = await open_loop(target, queries, spec, rec, poisson_stream(spec.rate, spec.seed), t0, halt)
        else:
            t_measure = await open_loop(target, queries, spec, rec, iter(times / spec.replay_speed), t0, halt)
        if marker is not None and not (halt is not None and halt.is_set() and not marker.done()):
            await marker
    finally:
        if marker is not None and not marker.done():
            marker.cancel()
        if ticker is not None:
            ticker.cancel()
            on_progress(rec, now() - t_start)
        await target.close()
    result = _result(rec, spec, getattr(target, "name", type(target).__name__), t_measure)
    result.interrupted = halt is not None and halt.is_set()
    result.generator_cpu_s, result.generator_wall_s = time.process_time() - cpu0, now() - wall0
    return result


def sweep_specs(base: LoadSpec, levels: list[float]) -> list[LoadSpec]:
    """One spec per level: concurrency levels for closed loop, rates for open loop."""
    if base.mode == "open":
        return [replace(base, rate=float(r), seed=base.seed + i) for i, r in enumerate(levels)]
    return [replace(base, concurrency=int(c), seed=base.seed + i) for i, c in enumerate(levels)]
