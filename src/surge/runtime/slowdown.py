"""A test-only engine slow-down: a fixed sleep added to every engine batch.

Overload, queueing and timeout behaviour depend on how long a batch takes
relative to the request timeout. On a real engine that is the machine's speed,
so a test of "the queue fills, queued inputs expire, the server recovers"
would pass or fail with the load on the machine. With
`SURGE_TEST_ENGINE_DELAY_MS=2000` every batch takes at least two seconds
(plus its compute), whatever the CPU, and such a test is deterministic.

Read when a model is loaded (not at import); unset or 0 (the default) leaves
the engines untouched. Not a tuning knob: never set it in production.
"""

from __future__ import annotations

import functools
import logging
import os
import time

ENV = "SURGE_TEST_ENGINE_DELAY_MS"
log = logging.getLogger("surge")


def engine_delay_s() -> float:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of milliseconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV} must not be negative, got {raw!r}")
    return value / 1000.0


def slow_down(engines, delay_s: float) -> None:
    """Make every engine in the pool sleep `delay_s` after each batch it runs."""
    if delay_s <= 0:
        return
    log.warning("%s is set: every engine batch is slowed by %.3f s (a test setting)", ENV, delay_s)
    for engine in engines.engines:
        run = engine.run

        @functools.wraps(run)
        def slowed(batch, _run=run):
            out = _run(batch)
            time.sleep(delay_s)  # in the engine's own thread, like real compute
            return out

        engine.run = slowed
