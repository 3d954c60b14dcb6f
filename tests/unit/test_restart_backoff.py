"""The --workers supervisor's wait before starting a child again (cli/workers_supervisor.RestartBackoff): a
child that keeps dying at once is started again after 0.5, 1, 2, ... s up to the cap, not in a tight loop;
one that ran for a while before it exited starts again at once, and its count starts over."""

from __future__ import annotations

from surge.cli.workers_supervisor import RestartBackoff


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_child_that_keeps_dying_waits_longer_each_time_up_to_the_cap():
    clock = Clock()
    b = RestartBackoff(first_s=0.5, cap_s=4.0, healthy_s=60.0, clock=clock)
    waits = []
    for _ in range(6):
        b.started(("engine", 0))
        clock.now += 1.0  # died a second after it started
        waits.append(b.delay(("engine", 0)))
        clock.now += waits[-1]
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_child_that_ran_long_enough_starts_again_at_once_and_its_count_starts_over():
    clock = Clock()
    b = RestartBackoff(first_s=0.5, cap_s=30.0, healthy_s=60.0, clock=clock)
    for _ in range(3):
        b.started(("front", 1))
        clock.now += 1.0
        b.delay(("front", 1))
    b.started(("front", 1))
    clock.now += 120.0  # served for two minutes
    assert b.delay(("front", 1)) == 0.0
    b.started(("front", 1))
    clock.now += 1.0
    assert b.delay(("front", 1)) == 0.5  # from the start again


def test_children_are_counted_apart():
    clock = Clock()
    b = RestartBackoff(first_s=0.5, cap_s=30.0, healthy_s=60.0, clock=clock)
    b.started(("engine", 0))
    b.started(("engine", 1))
    clock.now += 1.0
    assert b.delay(("engine", 0)) == 0.5
    b.started(("engine", 0))
    clock.now += 1.0
    assert b.delay(("engine", 0)) == 1.0
    assert b.delay(("engine", 1)) == 0.5
