"""How a request's failure is counted: one rule for every served-model class.

A SurgeError counts under its own code, a cancellation (the client left) as
"cancelled", anything else as "internal_error"; the exception goes on either way.
"""

from __future__ import annotations

import asyncio
import contextlib

from surge.errors import SurgeError


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
