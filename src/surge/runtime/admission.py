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


class Admission:
    def __init__(self, max_items: int, name: str = "model"):
        self.max_items = max_items
        self.name = name
        self.inflight = 0
        self.closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Exponentially weighted drain rate (inputs per second), for Retry-After.
        self._rate = 0.0
        self._last = time.monotonic()

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
        if not self.inflight:
            # A busy period starts: the drain rate is measured from here, not across the idle time before it
            # (which made the first Retry-After after a quiet minute tens of seconds for a sub-second backlog).
            self._last = time.monotonic()
        self.inflight += n
        self._idle.clear()

    def release(self, n: int, done: bool = True) -> None:
        self.inflight -= n
        if done:
            now = time.monotonic()
            dt = max(now - self._last, 1e-4)
            self._last = now
            alpha = min(1.0, dt)  # about a one-second memory
            self._rate = (1 - alpha) * self._rate + alpha * (n / dt)
        if self.inflight <= 0:
            self.inflight = 0
            self._idle.set()

    def retry_after(self) -> float:
        """Seconds until the current backlog should have drained (at least 1)."""
        if self._rate <= 0:
            return 1.0
        return float(max(1, math.ceil(self.inflight / self._rate)))

    async def drain(self) -> None:
        """Refuse new work and wait until everything admitted has finished."""
        self.closed = True
        await self._idle.wait()
