"""Admission's Retry-After is the backlog over the drain rate measured while work was in flight."""

from __future__ import annotations

import pytest

from surge.errors import Overloaded
from surge.runtime import admission as admission_mod
from surge.runtime.admission import Admission


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(admission_mod.time, "monotonic", c)
    return c


def test_idle_time_before_a_burst_is_not_counted_as_slow_draining(clock):
    """A server idle for a minute, then a batch of 32 inputs drained in 0.2 s (160 inputs/s): a refused
    request is told to come back in about a second, not in the 60 s that 32 inputs over the idle minute
    (0.5 inputs/s) would make it (a first burst after idle answered `Retry-After: 32` and more)."""
    a = Admission(32, "m")
    clock.t += 60.0  # idle
    a.admit(32)
    clock.t += 0.2
    a.release(32)
    a.admit(32)  # the next burst
    with pytest.raises(Overloaded) as err:
        a.admit(1)
    assert err.value.retry_after == 1  # the floor: the backlog drains within a second


def test_retry_after_follows_a_slow_drain(clock):
    """The other way round: inputs that take 2 s each under load make Retry-After long."""
    a = Admission(4, "m")
    a.admit(4)
    for _ in range(4):
        clock.t += 2.0
        a.release(1)
    a.admit(4)
    with pytest.raises(Overloaded) as err:
        a.admit(1)
    assert err.value.retry_after == 8.0  # 4 inputs at 0.5 a second (the fake clock makes it exact)


def test_one_quick_request_measures_a_fast_drain(clock):
    """The server's warm-up (one input in 10 ms), a quiet spell, then a burst of 32: the backlog drains at
    about 100 inputs a second, so Retry-After is the 1 s floor (it was 32: one input released counted as
    one input a second, whatever time it took)."""
    a = Admission(32, "m")
    a.admit(1)
    clock.t += 0.01
    a.release(1)
    clock.t += 5.0
    a.admit(32)
    with pytest.raises(Overloaded) as err:
        a.admit(1)
    assert err.value.retry_after == 1
