"""Admission control: a bound on admitted work, and an honest Retry-After.

A service admits a request only while the inputs it holds (queued, being
tokenized or computed) stay under the bound; past it the request is refused at
once with 429 and a Retry-After estimated from the measured drain rate, so an
overloaded server answers quickly instead of letting queues (and latency) grow
without limit. Draining on shutdown waits on an event, not a polling loop.
"""

from __future__ import annotations

import asyncio
import math
import time

from surge.errors import NotReady, Overloaded

RATE_MEMORY_S = 10.0  # the drain rate's memory: releases this much older weigh 1/e


class Admission:
    def __init__(self, max_items: int, name: str = "model"):
        self.max_items = max_items
        self.name = name
        self.inflight = 0
        self.closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Drain rate for Retry-After: inputs released over the busy time (some input in flight) they took,
        # both decayed with wall time (RATE_MEMORY_S), so that the ratio follows recent load while idle
        # spells count for neither.
        self._done = 0.0
        self._busy = 0.0
        self._last = time.monotonic()  # the last release, or the start of the busy period after it

    def admit(self, n: int) -> None:
        """Take `n` inputs' worth of capacity or raise Overloaded / NotReady."""
        if self.closed:
            raise NotReady(f"model {self.name} is shutting down")
        # A request larger than the whole bound is still admitted when nothing
        # else is in flight, so that it can never be refused forever.
        if self.inflight and self.inflight + n > self.max_items:
            raise Overloaded(
                f"model {self.name} is overloaded ({self.inflight} inputs in flight); retry later",
                retry_after=self.retry_after(),
            )
        if not self.inflight:  # a busy period starts: the time since the last release was idle
            self._decay(time.monotonic())
        self.inflight += n
        self._idle.clear()

    def release(self, n: int, done: bool = True) -> None:
        if done:
            now = time.monotonic()
            busy = max(now - self._last, 1e-6)  # in flight all along (admit restarts the clock after idle)
            self._decay(now)
            self._done += n
            self._busy += busy
        self.inflight -= n
        if self.inflight <= 0:
            self.inflight = 0
            self._idle.set()

    def _decay(self, now: float) -> None:
        w = math.exp(-(now - self._last) / RATE_MEMORY_S)
        self._done *= w
        self._busy *= w
        self._last = now

    def retry_after(self) -> float:
        """Seconds until the current backlog should have drained at the measured rate (at least 1)."""
        if self._done <= 0 or self._busy <= 0:
            return 1.0
        return float(max(1, math.ceil(self.inflight * self._busy / self._done)))

    async def drain(self) -> None:
        """Refuse new work and wait until everything admitted has finished."""
        self.closed = True
        await self._idle.wait()
