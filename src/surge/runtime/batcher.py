"""The dynamic batcher: many callers' inputs in, engine-sized batches out.

One per model version. Callers `await submit(items, deadline, priority)` and
get back one row per item, in their own order; the engine sees batches.

How a batch is formed (continuous batching): a scheduler task waits for a free
engine instance, then for work, and dispatches at once: a lone request pays no
batching delay, and inputs accumulate only while every instance is busy, so a
saturated model runs full batches back to back and an idle one answers at
once. `max_queue_delay` is therefore an upper bound (met by construction), not
a wait. Inside a batch, inputs are grouped by length around the most urgent one (highest
priority, then oldest) to cut padding, and the token budget counts padded
tokens for padded engines.

Safety: inputs whose caller has gone (cancelled) or whose deadline passed are
dropped before compute; a batch's result must have exactly one row per input
or every caller in it gets an EngineError (never someone else's row).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import sys
import time
import traceback
import weakref
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from surge.errors import DeadlineExceeded, EngineError, NotReady, Overloaded
from surge.runtime.metrics import ServiceMetrics, multiprocess_dir
from surge.runtime.request import EXECUTIONS
from surge.types import Encoded

RunBatch = Callable[[list[Encoded]], np.ndarray]


@dataclass(eq=False)
class _Ticket:
    """One caller's submission: its future and where its rows go."""

    future: asyncio.Future
    n: int
    deadline: float | None
    priority: int
    out: np.ndarray | None = None
    remaining: int = 0
    timer: asyncio.TimerHandle | None = None
    timings: dict | None = None  # the caller's Request.timings: queue_ns and compute_infer_ns added here


@dataclass(eq=False, slots=True)
class _Entry:
    ticket: _Ticket
    index: int
    item: Encoded
    length: int
    seq: int
    arrived: float


@dataclass(frozen=True)
class BatchRecord:
    """What one dispatched batch looked like (kept for tests and benchmarks)."""

    size: int
    real_tokens: int
    cost_tokens: int  # padded tokens for padded engines
    oldest_wait_s: float  # dispatch time minus the oldest input's arrival
    free_wait_s: float  # dispatch time minus the moment an instance was free and work was queued


@dataclass
class BatcherConfig:
    enabled: bool = True
    max_batch_size: int = 64
    max_batch_tokens: int = 8192
    max_queue_delay_s: float = 0.002
    max_queue_size: int = 2048
    max_padding_ratio: float = 1.0  # inputs that would push a batch's padding share past this wait
    instances: int = 1
    padded: bool = True
    history: int = 10_000


def _start_task(coro) -> asyncio.Task:
    """A task whose first step runs now where Python can (3.12+: eager start), else one loop pass
    later: a lone batch is launched in the scheduler's own step (a pass is tens of us on the H200
    host: docs/benchmarks/serving_core.md, session 5). Bound to the running loop (any loop class,
    uvloop included: the Task is asyncio's own)."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return loop.create_task(coro)


class DynamicBatcher:
    def __init__(self, run: RunBatch, executor: Executor, cfg: BatcherConfig,
                 metrics: ServiceMetrics | None = None, name: str = "model", split=None,
                 poll_s: float = 0.0):
        """`split`: (launch, wait, collect, ready) for engines that run a batch in halves
        (ModelWorker.compute_launch/_wait/_collect/_ready): launch and collect run on the event
        loop, only wait on the executor, so the engine's host work never waits for the GIL. With
        `ready` (a non-blocking "is it done?", or None) and `poll_s` > 0, a batch that is the only
        one in flight is checked on the loop between its other callbacks for up to poll_s; the
        executor waits only for a batch still running then or launched beside another. A small
        batch's GPU time is about what the hand-off to a thread and the wake-up after it cost
        (docs/benchmarks/serving_core.md, session 4)."""
        self._run = run
        self._split = split
        self.poll_s = float(poll_s)
        self.polled_batches = 0  # batches whose wait ended on the loop (no thread)
        self._executor = executor
        self.cfg = cfg
        self.name = name
        self.metrics = metrics
        self.max_batch_size = cfg.max_batch_size if cfg.enabled else 1
        self._pending: list[_Entry] = []
        self._pending_tokens = 0
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._forming = False  # the scheduler holds a slot and waits for (or forms) a batch
        self._slots = asyncio.Semaphore(max(1, cfg.instances))
        self._running: set[asyncio.Task] = set()
        self._executing = 0  # batches between launch and their rows (what polling checks)
        self._scheduler: asyncio.Task | None = None
        self._slot_free_at = 0.0
        self._closed = False
        self.history: collections.deque[BatchRecord] = collections.deque(maxlen=cfg.history)
        self.computed_inputs = 0  # inputs that reached the engine
        self._depth_gauge = None
        if metrics is not None and multiprocess_dir() is not None:
            self._depth_gauge = metrics.queue_depth  # several processes: each writes its own value
        elif metrics is not None:
            # Read at scrape time: a Gauge.set per submit and per batch took a lock each time
            # (7% of the event loop's samples at 64 clients). A weak reference, so a retired
            # version's batcher is not kept alive by its labels' gauge.
            ref = weakref.ref(self)
            metrics.queue_depth.set_function(lambda: len(ref()._pending) if ref() is not None else 0)
        self.dropped_inputs = 0  # inputs dropped before compute (cancelled or expired)

    # ---- the caller's side -------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    async def submit(self, items: list[Encoded], deadline: float | None = None, priority: int = 0,
                     timings: dict | None = None) -> np.ndarray:
        """Rows for `items`, in order. `deadline` is a time.monotonic() value;
        a higher `priority` is served first. `timings` (a dict) gets the time the
        inputs waited (queue_ns, the longest of them) and computed (compute_infer_ns)."""
        return await self.enqueue(items, deadline, priority, timings)

    def enqueue(self, items: list[Encoded], deadline: float | None = None, priority: int = 0,
                timings: dict | None = None, timer: bool = True) -> asyncio.Future:
        """`submit` without the coroutine: the future of the rows (cancel it to withdraw the inputs).

        The engine process (runtime/ipc.py) takes thousands of requests a second this way, with a
        done-callback instead of a task per request. `timer=False`: no expiry timer per request
        (expired inputs are still dropped when a batch is formed; the caller enforces its own
        deadline and cancels), which saves a timer-heap entry per request.
        """
        if self._closed:
            raise NotReady(f"model {self.name} is shutting down")
        if not items:
            raise ValueError("submit needs at least one item")
        # Inputs a free instance takes at once are not queued: without this, requests arriving in
        # one event-loop pass (before the scheduler runs) counted the first batch as queue.
        # The scheduler waiting for work holds a slot too (`_forming`): its instance is free.
        free = getattr(self._slots, "_value", 0) + self._forming
        room = self.cfg.max_queue_size + free * self.max_batch_size
        if self._pending and len(self._pending) + len(items) > room:
            raise Overloaded(f"the queue of model {self.name} is full ({len(self._pending)} inputs); retry later",
                             retry_after=1.0)
        loop = asyncio.get_running_loop()
        if self._scheduler is None:
            self._scheduler = loop.create_task(self._schedule(), name=f"surge-batcher-{self.name}")
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            self._drop_count("expired", len(items))
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        ticket = _Ticket(loop.create_future(), len(items), deadline, priority, remaining=len(items), timings=timings)
        for i, it in enumerate(items):
            entry = _Entry(ticket, i, it, len(it), next(self._seq), now)
            self._pending.append(entry)
            self._pending_tokens += entry.length
        if deadline is not None and timer:
            ticket.timer = loop.call_at(loop.time() + (deadline - now), self._expire, ticket)
        ticket.future.add_done_callback(lambda f, t=ticket: self._settled(t))
        self._depth_changed()
        self._wake.set()
        return ticket.future

    def _expire(self, ticket: _Ticket) -> None:
        if not ticket.future.done():
            ticket.future.set_exception(DeadlineExceeded("the request's deadline passed while it was queued"))

    def _settled(self, ticket: _Ticket) -> None:
        """A ticket finished (result, error, cancel or expiry): forget its queued inputs."""
        if ticket.timer is not None:
            ticket.timer.cancel()
        cancelled = ticket.future.cancelled()
        if not cancelled and ticket.future.exception() is None:
            return  # answered: none of its inputs is queued any more
        before = len(self._pending)
        if before:
            self._pending = [e for e in self._pending if e.ticket is not ticket]
            dropped = before - len(self._pending)
            if dropped:
                self._pending_tokens = sum(e.length for e in self._pending)
                if cancelled:
                    reason = "cancelled"
                elif isinstance(ticket.future.exception(), DeadlineExceeded):
                    reason = "expired"
                else:
                    reason = "failed"
                self._drop_count(reason, dropped)
                self._depth_changed()

    def _drop_count(self, reason: str, n: int) -> None:
        self.dropped_inputs += n
        if self.metrics is not None:
            self.metrics.dropped(reason, n)

    def _depth_changed(self) -> None:
        if self._depth_gauge is not None:  # else the gauge reads the queue at scrape time (see __init__)
            self._depth_gauge.set(len(self._pending))

    # ---- the scheduler -----------------------------------------------------
    async def _schedule(self) -> None:
        while True:
            await self._slots.acquire()
            self._slot_free_at = time.monotonic()
            self._forming = True
            try:
                batch, free_at = await self._next_batch()
                self._forming = False
            except BaseException:
                self._forming = False
                self._slots.release()
                raise
            task = _start_task(self._execute(batch, free_at))
            if not task.done():
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _next_batch(self) -> tuple[list[_Entry], float]:
        """The next batch, formed the moment an instance is free and work is queued.

        Called with an engine slot held. Nothing waits here for company: a
        lone request leaves at once, and inputs accumulate only while every
        instance is busy (continuous batching), so `max_queue_delay` is an
        upper bound that the scheduler meets by construction, not a wait.
        """
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.monotonic()
            batch = self._form(now)
            if batch:
                return batch, max(self._slot_free_at, min(e.arrived for e in batch))

    def _form(self, now: float) -> list[_Entry]:
        live = []
        for e in self._pending:
            t = e.ticket
            if t.future.done():
                continue  # settled callbacks purge these; skip any not yet purged
            if t.deadline is not None and t.deadline <= now:
                self._expire(t)
                continue
            live.append(e)
        if not live:
            self._pending, self._pending_tokens = [], 0
            self._depth_changed()
            return []
        # The anchor is the most urgent input: highest priority, then oldest.
        top = max(e.ticket.priority for e in live)
        anchor = next(e for e in live if e.ticket.priority == top)
        batch = [anchor]
        if self.max_batch_size > 1:
            others = [e for e in live if e is not anchor]
            # Group by length around the anchor; priority first, then age.
            others.sort(key=lambda e: (-e.ticket.priority, abs(e.length - anchor.length), e.seq))
            width, real = anchor.length, anchor.length
            budget = self.cfg.max_batch_tokens
            for e in others:
                if len(batch) >= self.max_batch_size:
                    break
                w = max(width, e.length)
                cost = w * (len(batch) + 1) if self.cfg.padded else real + e.length
                if cost > budget:
                    continue
                if self.cfg.padded and 1.0 - (real + e.length) / cost > self.cfg.max_padding_ratio:
                    # Padded tokens cost as much as real ones: an input this far
                    # from the batch's length waits for the next batch (which,
                    # with the engine busy, leaves as soon as an instance frees).
                    continue
                batch.append(e)
                width, real = w, real + e.length
            # Keep each caller's inputs in order inside the batch (not needed
            # for correctness, rows are scattered by index, but easier to read).
            batch.sort(key=lambda e: e.seq)
        taken = set(map(id, batch))
        self._pending = [e for e in live if id(e) not in taken]
        self._pending_tokens = sum(e.length for e in self._pending)
        self._depth_changed()
        return batch

    async def _poll(self, ready, pending) -> bool:
        """True once `ready(pending)`, checked between the loop's other callbacks (sleep(0)
        yields to them: IPC reads and other batches go on); False after poll_s."""
        end = time.monotonic() + self.poll_s
        while not ready(pending):
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0)
        return True

    def _record(self, batch: list[_Entry], start: float, free_at: float) -> None:
        lengths = [e.length for e in batch]
        real = sum(lengths)
        cost = max(lengths) * len(batch) if self.cfg.padded else real
        self.history.append(BatchRecord(len(batch), real, cost, start - min(e.arrived for e in batch),
                                        start - free_at))
        m = self.metrics
        if m is not None:
            m.batch_size.observe(len(batch))
            m.batch_tokens.observe(cost)
            m.padding.observe(1.0 - real / cost if cost else 0.0)
            for e in batch:
                m.queue.observe(start - e.arrived)

    async def _execute(self, batch: list[_Entry], free_at: float) -> None:
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        self._executing += 1
        try:
            self.computed_inputs += len(batch)
            if self._split is not None:
                launch, wait, collect, ready = self._split
                pending = launch([e.item for e in batch])
                # Counted while the GPU runs the batch, not before it is launched.
                self._record(batch, start, free_at)
                try:
                    # Polled only while this is the one batch in flight: with two in flight (load)
                    # the loop has IPC to serve and polling cost the H200 run 3-6% at 256 clients
                    # (docs/benchmarks/serving_core.md, session 4).
                    if (ready is not None and self.poll_s > 0 and self._executing <= 1
                            and await self._poll(ready, pending)):
                        self.polled_batches += 1
                    else:
                        await loop.run_in_executor(self._executor, wait, pending)
                finally:
                    rows = collect(pending)  # also frees the engine's slot if the wait failed
            else:
                self._record(batch, start, free_at)
                rows = await loop.run_in_executor(self._executor, self._run, [e.item for e in batch])
            took = time.monotonic() - start
            m = self.metrics
            if m is not None:
                m.compute.observe(took)
            seen = set()
            for e in batch:
                tm = e.ticket.timings
                if tm is not None:
                    wait = int((start - e.arrived) * 1e9)
                    if wait > tm.get("queue_ns", 0):
                        tm["queue_ns"] = wait
                    if id(e.ticket) not in seen:  # a caller's inputs in one batch: one compute time
                        # KServe's execution_count counts model executions (batches), not requests: the
                        # batch is credited to its first caller, so the callers' counts sum to the batches
                        tm[EXECUTIONS] = tm.get(EXECUTIONS, 0) + (not seen)
                        seen.add(id(e.ticket))
                        tm["compute_infer_ns"] = tm.get("compute_infer_ns", 0) + int(took * 1e9)
            if rows.shape[0] != len(batch):
                raise EngineError(f"engine returned {rows.shape[0]} rows for a batch of {len(batch)}")
        except Exception as exc:
            err = exc if isinstance(exc, EngineError) else EngineError(f"batch failed: {type(exc).__name__}: {exc}")
            callers: dict[int, list[_Entry]] = {}
            for e in batch:
                callers.setdefault(id(e.ticket), []).append(e)
            if len(callers) == 1:
                self._fail(batch, err)
            else:
                # A result must not depend on who shared the batch: run it again one caller at a time, so only
                # the callers whose own inputs fail get an error (the engine slot is still held here).
                for group in callers.values():
                    await self._run_alone(loop, group)
            return
        finally:
            self._executing -= 1
            self._slots.release()
        self._deliver(batch, rows)

    @staticmethod
    def _fail(entries: list[_Entry], err: Exception) -> None:
        for e in entries:
            if not e.ticket.future.done():
                e.ticket.future.set_exception(err)

    async def _run_alone(self, loop, group: list[_Entry]) -> None:
        """One caller's inputs of a failed batch, run by themselves."""
        if group[0].ticket.future.done():  # cancelled, or expired meanwhile
            return
        try:
            rows = await loop.run_in_executor(self._executor, self._run, [e.item for e in group])
            if rows.shape[0] != len(group):
                raise EngineError(f"engine returned {rows.shape[0]} rows for a batch of {len(group)}")
        except Exception as exc:  # noqa: BLE001 - this caller's own failure
            self._fail(group, exc if isinstance(exc, EngineError) else
                       EngineError(f"batch failed: {type(exc).__name__}: {exc}"))
            return
        self._deliver(group, rows)

    @staticmethod
    def _deliver(entries: list[_Entry], rows) -> None:
        for i, e in enumerate(entries):
            t = e.ticket
            if t.future.done():
                continue
            if t.out is None:
                t.out = np.empty((t.n, *rows.shape[1:]), dtype=rows.dtype)
            t.out[e.index] = rows[i]
            t.remaining -= 1
            if t.remaining == 0:
                t.future.set_result(t.out)

    async def close(self) -> None:
        """Stop taking work, let queued and running batches finish, stop the scheduler."""
        self._closed = True
        waiting = {e.ticket.future for e in self._pending}
        self._wake.set()
        if waiting:
            await asyncio.wait(waiting)
        if self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)
        if self._scheduler is not None:
            self._scheduler.cancel()
            try:
                await self._scheduler
            except asyncio.CancelledError as exc:
                # Its traceback's frames (the scheduler's) hold this batcher, and so the service's engines,
                # for as long as the traceback lives: asyncio's task step that awaited close() keeps it until
                # it returns to the loop, past a retirement that frees the build (runtime/gc_settle.py).
                traceback.clear_frames(exc.__traceback__)
                exc.__traceback__ = None  # and this frame's own (executing, so not cleared)
