"""How a request is counted and admitted: one rule for every served-model class.

A SurgeError counts under its own code, a cancellation (the client left) as
"cancelled", anything else as "internal_error"; the exception goes on either way.

A request answered counts (its latency observed: `answered`; its KServe statistics: server/state.py) when the
runtime hands its answer over, or, where the protocol awaits the answer's delivery (`awaiting`: the gRPC port's
ModelInfer and each request of ModelStreamInfer, server/grpc/send_deadline.py and extras.py), once it is delivered;
an answer lost first (its connection cut) counts as a failure "cancelled" instead, never as both. The HTTP port's
generations wait for their delivery the same way, through server/http/delivery.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextvars import ContextVar, Token

from surge.errors import NotReady, SurgeError

CANCELLED = "cancelled"


class Delivery:
    """One answer's fate: None once it is delivered, else the failure code its requests count under ("cancelled":
    the connection was lost first; "internal_error": the handler failed after them). `then(callback)` runs
    `callback(code)` once settled (at once if it is)."""

    __slots__ = ("_waiting", "code", "settled")

    def __init__(self):
        self.settled = False
        self.code: str | None = None
        self._waiting: list[Callable[[str | None], None]] = []

    @property
    def pending(self) -> bool:
        """Something waits for it to settle."""
        return bool(self._waiting)

    def then(self, callback: Callable[[str | None], None]) -> None:
        if self.settled:
            callback(self.code)
        else:
            self._waiting.append(callback)

    def settle(self, code: str | None) -> None:
        if self.settled:
            return
        self.settled, self.code = True, code
        waiting, self._waiting = self._waiting, []
        for callback in waiting:
            callback(code)


# The delivery the current task's answer awaits (set by the gRPC port; the HTTP port's generations: http/delivery.py)
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
    if d is None:
        metrics.latency.observe(seconds)
        return
    latency = metrics.latency

    def settle(code: str | None) -> None:
        if code is None:
            latency.observe(seconds)
        else:
            metrics.failure(code)

    d.then(settle)


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
