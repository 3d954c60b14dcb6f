"""Per-request metrics written once per event-loop pass (front ends under `--workers`).

Under `--workers` every process writes prometheus_client's multiprocess files (mmap), and one
counter increment is a lock, a pid check and a packed write: a plain embedding request made
about ten of them (requests, inputs, in flight up and down, three histograms of two values each),
~8% of a front end's CPU on the H200 host. Here the request's own metrics are added up in plain
Python numbers and written to the real children once per loop pass (a `call_soon` scheduled by
the first update of the pass), so a wave of requests costs one write per series. The values reach
the files one loop iteration later, before any later request (e.g. a /metrics scrape) is served,
so metrics stay whole across processes.

Only for updates made on the event loop's thread; from any other thread (or with no running loop)
an update is written through at once. Gauges buffer their net change.
"""

from __future__ import annotations

import asyncio
import bisect
import threading


class _Flusher:
    """The series updated during this loop pass, flushed together after it."""

    def __init__(self):
        self.dirty: list = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: int | None = None

    def mark(self, series) -> bool:
        """Queue `series` for this pass's flush; False when the caller must write through."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if loop is not self.loop:  # first use, or a new loop (tests run several)
            if self.loop is not None and self.thread != threading.get_ident() and not self.loop.is_closed():
                return False  # another thread's loop: write through
            if self.dirty:
                self.flush()
            self.loop = loop
            self.thread = threading.get_ident()
        if not self.dirty:
            loop.call_soon(self.flush)
        self.dirty.append(series)
        return True

    def flush(self) -> None:
        dirty, self.dirty = self.dirty, []
        for s in dirty:
            s.flush()


_flusher = _Flusher()


def flush_all() -> None:
    """Write every buffered update now (e.g. before a scrape from this process, or at exit)."""
    _flusher.flush()


class BufferedCounter:
    """`inc(n)` (and `dec(n)` for gauges) on a prometheus child, written once per loop pass."""

    __slots__ = ("child", "pending", "queued")

    def __init__(self, child):
        self.child = child
        self.pending = 0.0
        self.queued = False

    def inc(self, amount: float = 1) -> None:
        if self.queued and threading.get_ident() == _flusher.thread:
            self.pending += amount
        elif not self.queued and _flusher.mark(self):
            self.queued = True
            self.pending += amount
        else:  # no loop here, or another thread's update: written at once
            if amount < 0:
                self.child.dec(-amount)
            else:
                self.child.inc(amount)

    def dec(self, amount: float = 1) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:  # gauges: a set is written at once, after what is pending
        self.flush()
        self.child.set(value)

    def flush(self) -> None:
        self.queued = False
        n, self.pending = self.pending, 0.0
        if n:
            if n < 0:
                self.child.dec(-n)
            else:
                self.child.inc(n)


class BufferedHistogram:
    """`observe(v)` on a prometheus histogram child: bucket counts and the sum written once per pass."""

    __slots__ = ("child", "bounds", "counts", "total", "queued", "_direct")

    def __init__(self, child):
        self.child = child
        self.bounds = list(getattr(child, "_upper_bounds", ()))
        # prometheus_client's value objects (the same ones observe() writes); where a version lacks
        # them, observations are written through one by one.
        self._direct = (bool(self.bounds) and len(getattr(child, "_buckets", ())) == len(self.bounds)
                        and hasattr(child, "_sum"))
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.queued = False

    def observe(self, amount: float) -> None:
        if not self._direct:
            self.child.observe(amount)
            return
        if not (self.queued and threading.get_ident() == _flusher.thread):
            if self.queued or not _flusher.mark(self):
                self.child.observe(amount)
                return
            self.queued = True
        i = bisect.bisect_left(self.bounds, amount)  # observe(): the first bucket with amount <= bound
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += amount

    def flush(self) -> None:
        self.queued = False
        counts = self.counts
        total, self.total = self.total, 0.0
        self.child._raise_if_not_observable()
        self.child._sum.inc(total)
        buckets = self.child._buckets
        for i, c in enumerate(counts):
            if c:
                buckets[i].inc(c)
                counts[i] = 0
