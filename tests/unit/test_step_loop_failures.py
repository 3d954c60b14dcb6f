"""The step loop when the engine raises (EngineLoop fails the requests of loop.involved() and goes on): every
sequence the failed step was running is either reported finished in a StepResult or named by involved(), so
that no request is left without an end (no torch, the scheduler's fake engine)."""

from __future__ import annotations

import pytest

from surge.runtime.scheduler import Scheduler, SchedulerConfig, SeqStatus, Sequence
from surge.runtime.scheduler.overlap import StepLoop
from tests.unit.test_scheduler import FakeTokenEngine, greedy


class Failing(FakeTokenEngine):
    """collect_tokens() raises at its `fail_at`-th call (0 first): an asynchronous device error surfaces where
    the host waits for the device."""

    def __init__(self, depth, steps, fail_at):
        super().__init__(depth, steps)
        self.reads, self.fail_at = 0, fail_at

    def collect_tokens(self, handle):
        self.reads += 1
        if self.reads - 1 == self.fail_at:
            raise RuntimeError("device error")
        return super().collect_tokens(handle)


def _serve(loop, sched, seqs, arrivals=None):
    """EngineLoop.run's handling: results reported, an exception fails loop.involved(); seqs[i] is added before
    iteration arrivals[i] (all at 0 by default). -> (ended seq ids, failed seq ids, iterations)."""
    ended, failed = set(), set()
    arrivals = arrivals or [0] * len(seqs)
    for it in range(200):
        for q, at in zip(seqs, arrivals):
            if at == it:
                sched.add(q)
        if not loop.busy and it >= max(arrivals):
            return ended, failed, it
        try:
            results = loop.step()
        except RuntimeError:
            for q in loop.involved():
                sched.abort(q, "error")
                failed.add(q.seq_id)
            continue
        for r in results:
            ended.update(f.seq.seq_id for f in r.finished)
    raise AssertionError(f"the loop never went idle: running {[q.seq_id for q in sched.running]}, "
                         f"ended {ended}, failed {failed}")


@pytest.mark.parametrize("depth,steps", [(1, 1), (2, 1), (2, 3)])
@pytest.mark.parametrize("fail_at", range(5))
def test_a_read_back_that_raises_leaves_no_sequence_without_an_end(depth, steps, fail_at):
    """Two sequences of different lengths (the shorter drains: its last launch is in no later one); the engine
    raises at one read-back. Every sequence is either reported finished or failed through involved(), and the loop
    goes idle with every block free (a drained sequence whose last launch raised used to stay running for ever)."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=96), ())
    engine = Failing(depth, steps, fail_at)
    loop = StepLoop(sched, engine, overlap=True, depth=depth, steps=steps)
    seqs = [Sequence(0, [11, 12, 13, 14, 15], greedy(14)), Sequence(1, [21, 22, 23], greedy(6))]
    ended, failed, _ = _serve(loop, sched, seqs)
    assert engine.reads > fail_at, "the engine must have raised"
    for q in seqs:
        assert q.status is SeqStatus.FINISHED
        assert q.seq_id in ended | failed, f"sequence {q.seq_id} was neither reported finished nor failed"
    assert sched.blocks.num_free == 64


@pytest.mark.parametrize("arrive", range(3, 9))
@pytest.mark.parametrize("fail_at", range(1, 6))
def test_a_sequence_finished_in_a_failed_step_is_reported(arrive, fail_at):
    """A prompt arriving while launches are in flight makes the loop read them all back (_complete_all) before a
    synchronous step. A sequence that finishes (max_tokens) at the first of those read-backs, when a later one
    raises, had its end only in the failed step's results: involved() must still name it."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=96), ())
    engine = Failing(2, 1, fail_at)
    loop = StepLoop(sched, engine, overlap=True, depth=2, steps=1)
    seqs = [Sequence(0, [11, 12, 13, 14, 15], greedy(14)), Sequence(1, [21, 22, 23], greedy(5)),
            Sequence(2, [31, 32, 33, 34], greedy(3))]
    ended, failed, _ = _serve(loop, sched, seqs, [0, 0, arrive])
    assert engine.reads > fail_at, "the engine must have raised"
    for q in seqs:
        assert q.status is SeqStatus.FINISHED
        assert q.seq_id in ended | failed, f"sequence {q.seq_id} was neither reported finished nor failed"
    assert sched.blocks.num_free == 64
