"""How a request is counted and admitted: one rule for every served-model class.

A SurgeError counts under its own code, a cancellation (the client left) as
"cancelled", anything else as "internal_error"; the exception goes on either way.

A request answered counts (its latency observed: `answered`; its KServe statistics: server/state.py) when the
runtime hands its answer over, or, where the protocol awaits the answer's delivery (`awaiting`), once it is
delivered; an answer lost first (its connection cut) counts as a failure "cancelled" instead, never as both. Every
POST of the HTTP port awaits it (server/http/delivery.py: the routes, the hot paths, the direct path of
server/http/direct.py), and so do the gRPC port's ModelInfer and each request of ModelStreamInfer
(server/grpc/send_deadline.py and extras.py).

The HTTP port counts at WRITE time (`AtWrite`): the runtime's counts are held in the awaited object's own slots (no
callback made), and once the answer's last byte is written they count at once where the kernel took it all, as it
nearly always does; only an answer whose tail waits in the server's buffers waits on (a Delivery the protocol
settles once they drain, "cancelled" if the connection is lost first).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from contextvars import ContextVar, Token

from surge.errors import NotReady, SurgeError

CANCELLED = "cancelled"


class Delivery:
    """One answer's fate: None once it is delivered, else the failure code its requests count under ("cancelled":
    the connection was lost first; "internal_error": the handler failed after them). `then(callback)` runs
    `callback(code)` once settled (at once if it is); `answered` and `record`: the runtime's counts of a request
    answered, made once it is settled (server/state.AppState.call, `answered`). The list of callbacks is made by
    the first `then`."""

    __slots__ = ("_waiting", "code", "settled")

    def __init__(self):
        self.settled = False
        self.code: str | None = None
        self._waiting: list[Callable[[str | None], None]] | None = None

    @property
    def pending(self) -> bool:
        """Something waits for it to settle."""
        return bool(self._waiting)

    def then(self, callback: Callable[[str | None], None]) -> None:
        if self.settled:
            callback(self.code)
        elif self._waiting is None:
            self._waiting = [callback]
        else:
            self._waiting.append(callback)

    def settle(self, code: str | None) -> None:
        if self.settled:
            return
        self.settled, self.code = True, code
        waiting, self._waiting = self._waiting, None
        for callback in waiting or ():
            callback(code)

    def sent(self, ok: bool) -> None:
        """A protocol's word on the answer's bytes (server/http/frontend.DisconnectWatch.when_sent): all taken by
        the kernel (delivered), or the connection lost first ("cancelled")."""
        self.settle(None if ok else CANCELLED)

    def answered(self, metrics, seconds: float) -> None:
        """A request answered `seconds` after it began: its latency observed on `metrics` once delivered, else a
        failure under the settling code."""
        if self.settled:
            _count(metrics, seconds, self.code)
        else:
            self.then(functools.partial(_count, metrics, seconds))

    def record(self, record: Callable[..., None], *args) -> None:
        """`record(*args)` (the KServe statistics' success) once delivered; nothing where it is not (the loss
        counts through `answered`)."""
        if self.settled:
            if self.code is None:
                record(*args)
        else:
            self.then(functools.partial(_record, record, args))


def _count(metrics, seconds: float, code: str | None) -> None:
    if code is None:
        metrics.latency.observe(seconds)
    else:
        metrics.failure(code)


def _record(record, args, code: str | None) -> None:
    if code is None:
        record(*args)


class AtWrite(Delivery):
    """A Delivery settled as its answer is written (server/http/delivery.py): the request's first latency and
    first record are held in slots, not callbacks, and `written` counts them at once where the kernel took the
    answer whole (no future or callback made; the record, as before, right after the loop pass); only where bytes
    wait in the server's buffers does it wait for the protocol's word (`DisconnectWatch.when_sent`). Anything more
    (a second count, a `then`) goes the Delivery's way. Settled inside a running loop."""

    __slots__ = ("_args", "_metrics", "_record", "_seconds")

    def __init__(self):
        self.settled = False
        self.code = None
        self._waiting = None
        self._metrics = None
        self._record = None

    def answered(self, metrics, seconds: float) -> None:
        if self._metrics is None and not self.settled:
            self._metrics, self._seconds = metrics, seconds
        else:
            Delivery.answered(self, metrics, seconds)

    def record(self, record: Callable[..., None], *args) -> None:
        if self._record is None and not self.settled:
            self._record, self._args = record, args
        else:
            Delivery.record(self, record, *args)

    def settle(self, code: str | None) -> None:
        if self.settled:
            return
        metrics, record = self._metrics, self._record
        if metrics is not None:
            self._metrics = None
            _count(metrics, self._seconds, code)
        if record is not None:
            self._record = None
            if code is None:
                # right after this loop pass, as AppState.call recorded before: measured, recording here at once
                # cost the front end 3-5% more CPU a request (benchmarks/frontend_cpu.py; docs/benchmarks.md)
                asyncio.get_running_loop().call_soon(record, *self._args)
            self._args = None
        Delivery.settle(self, code)

    def written(self, watch) -> None:
        """Its answer's last byte just written on a connection with DisconnectWatch `watch` (server/http/frontend.py;
        None: a protocol without one, so handed over counts as delivered): settled now where nothing waits for it
        or none of the connection's bytes waits in the server's buffers; else once they drain, "cancelled" where
        the connection is lost first."""
        if watch is not None and (self._metrics is not None or self._record is not None or self._waiting) \
                and (watch.lost or watch.unsent()):  # something waits for it, and bytes may wait
            watch.when_sent(self.sent)
        else:
            self.settle(None)


# The delivery the current task's answer awaits (set by the HTTP port: server/http/delivery.py, direct.py; the gRPC
# port: server/grpc/send_deadline.py, extras.py)
_AWAITED: ContextVar[Delivery | None] = ContextVar("surge_awaited_delivery", default=None)


def awaiting(delivery: Delivery | None) -> Token:
    """The current task's answers (and those of the tasks it starts from now) count when `delivery` settles
    (None: when they are handed over); until `stop_awaiting(token)`."""
    return _AWAITED.set(delivery)


def stop_awaiting(token: Token) -> None:
    _AWAITED.reset(token)


def awaited() -> Delivery | None:
    """The delivery the current task's answer awaits, if any."""
    return _AWAITED.get()


def when_delivered(callback: Callable[[str | None], None]) -> bool:
    """Have `callback(code)` run once the current task's answer is delivered (code None) or lost (its failure
    code). False where no delivery is awaited (`callback` not kept): count now."""
    d = _AWAITED.get()
    if d is None:
        return False
    d.then(callback)
    return True


def answered(metrics, seconds: float) -> None:
    """A request answered, `seconds` after it began: its latency observed on `metrics` (a model's ServiceMetrics
    or RequestCounts), now, or once its answer is delivered where that is awaited, and a failure under the
    loss's code instead where it is lost."""
    d = _AWAITED.get()
    # quiet (ServiceMetrics.quiet: a load's warm-up, maybe inside a load request that awaits its answer's
    # delivery): counted nowhere, decided now, not once the metrics speak again
    if d is None or getattr(metrics, "is_quiet", False):
        metrics.latency.observe(seconds)
    else:
        d.answered(metrics, seconds)


def counts_of(service):
    """Where `service`'s requests and failures are counted (an object with `failure(code)`): a generation
    model's RequestCounts, any other model's metrics; None for a model that counts in its own process."""
    metrics = getattr(service, "metrics", None)
    counts = getattr(metrics, "outcome", metrics)
    return counts if hasattr(counts, "failure") else None


@contextlib.contextmanager
def count_failures(metrics):
    """Count an exception raised inside the block on `metrics.failure(code)`, then re-raise it."""
    try:
        yield
    except SurgeError as exc:
        metrics.failure(exc.code)
        raise
    except asyncio.CancelledError:
        metrics.failure("cancelled")
        raise
    except Exception:
        metrics.failure("internal_error")
        raise


@contextlib.contextmanager
def admitted(service, n: int, check=None):
    """One request of `n` inputs on a model service, around its body: counted (requests, inputs,
    failures by code), refused while the service is not ready (503), `check()` run next (its
    InvalidInput is a 400 that takes no admission slot), then admitted (429 when full) and held
    in flight until the body ends, however it ends."""
    m = service.metrics
    m.requests.inc()
    m.inputs.inc(n)
    taken = False
    try:
        with count_failures(m):
            if not service.ready:
                raise NotReady(f"model {service.name} version {service.version} is not ready")
            if check is not None:
                check()
            service.admission.admit(n)
            taken = True
            m.inflight.inc(n)
            yield
    finally:
        if taken:
            m.inflight.dec(n)
            service.admission.release(n)
