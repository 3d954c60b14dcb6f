"""How a request is counted and admitted: one rule for every served-model class.

A SurgeError counts under its own code, a cancellation (the client left) as
"cancelled", anything else as "internal_error"; the exception goes on either way.
"""

from __future__ import annotations

import asyncio
import contextlib

from surge.errors import NotReady, SurgeError


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
