"""The step loop when the engine raises (no torch, the scheduler's fake engine). loop.involved() (what the loop's end
fails): every sequence the failed step was running is either reported finished in a StepResult or named by it, so
that no request is left without an end. loop.contain() (what EngineLoop does since session 44): the failed step's
sequences run again alone, only one whose step alone raises fails, and the others' answers are unchanged."""

from __future__ import annotations

import pytest

from surge.runtime.scheduler import Scheduler, SchedulerConfig, SeqStatus, Sequence
from surge.runtime.scheduler.overlap import StepLoop
from surge.runtime.scheduler.params import SamplingParams
from surge.runtime.scheduler.sequence import PLACEHOLDER
from tests.unit.test_scheduler import FakeTokenEngine, expected, greedy


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



def step_or_contain(loop, sched, failed: set) -> tuple[list, bool]:
    """One iteration of the loop as the service runs it: the step's results, or after a step that raised, what
    contain() kept (its failed sequences aborted and added to `failed`); and whether the step raised."""
    try:
        return loop.step(), False
    except RuntimeError:
        results, bad = loop.contain()
        for q in bad:
            sched.abort(q, "error")
            failed.add(q.seq_id)
        return results, True

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


# -- a failed step contained per sequence (StepLoop.contain): the step's other sequences run again alone ----------


class Faulty(FakeTokenEngine):
    """Raises wherever sequence `bad` is in the work: at launch (`at` "launch"), at the read-back of a launch that
    holds it (`at` "collect": an asynchronous device error), and in any synchronous step of it (its step alone
    too); `broken`: every call raises (an engine that is gone)."""

    def __init__(self, depth, steps, bad=None, at="collect", broken=False):
        super().__init__(depth, steps)
        self.bad, self.at, self.broken, self.raised = bad, at, broken, 0

    def _check(self, ids, where):
        if self.broken or (where in (self.at, "step") and self.bad in ids):
            self.raised += 1
            raise RuntimeError("device error")

    def launch(self, scheduled, prev, steps=1):
        self._check({s.seq.seq_id for s in scheduled}, "launch")
        return super().launch(scheduled, prev, steps)

    def collect_tokens(self, handle):
        self._check(set(handle), "collect")
        return super().collect_tokens(handle)

    def step(self, scheduled):
        self._check({s.seq.seq_id for s in scheduled}, "step")
        return super().step(scheduled)


class FailingSync(Failing):
    """A synchronous step raises at the `fail_at`-th step (0 first)."""

    def step(self, scheduled):
        self.reads += 1
        if self.reads - 1 == self.fail_at:
            raise RuntimeError("device error")
        return super().step(scheduled)


def _serve_contained(loop, sched, seqs, arrivals=None, limit=400):
    """EngineLoop.run's handling: results handed out, an exception contained (loop.contain(): the results gathered
    before it handed out, the failed sequences aborted). -> (tokens streamed by seq id, failed seq ids, iterations)."""
    streamed, failed = {q.seq_id: [] for q in seqs}, set()
    arrivals = arrivals or [0] * len(seqs)
    for it in range(limit):
        for q, at in zip(seqs, arrivals):
            if at == it:
                sched.add(q)
        if not loop.busy and it >= max(arrivals):
            return streamed, failed, it
        results, _ = step_or_contain(loop, sched, failed)
        for r in results:
            for sid, token in r.tokens.items():
                streamed[sid].append(token)
        sched.blocks.check()
    raise AssertionError(f"the loop never went idle: running {[q.seq_id for q in sched.running]}, failed {failed}")


def _contained_seqs():
    return [Sequence(0, [11, 12, 13, 14, 15], greedy(14)), Sequence(1, [21, 22, 23], greedy(6)),
            Sequence(2, [31, 32, 33, 34, 35, 36, 37], greedy(9)), Sequence(3, [41, 42], greedy(11))]


@pytest.mark.parametrize("depth,steps", [(0, 1), (1, 1), (2, 1), (2, 3)])
@pytest.mark.parametrize("fail_at", range(5))
def test_a_read_back_that_raises_once_fails_no_request(depth, steps, fail_at):
    """A transient engine error (one read-back raises): no request fails; every sequence of the failed step runs
    again alone and then batched, and each gets the tokens a run without the error gives, each handed out once,
    in order (the launched tokens never read back are cut, those read back before the error kept); every block
    comes back. Depth 0: the synchronous loop, its step raising."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=96), ())
    engine = (Failing if depth else FailingSync)(max(depth, 1), steps, fail_at)
    loop = StepLoop(sched, engine, overlap=depth > 0, depth=max(depth, 1), steps=steps)
    seqs = _contained_seqs()
    streamed, failed, _ = _serve_contained(loop, sched, seqs, [0, 0, 0, 3])
    assert engine.reads > fail_at, "the engine must have raised"
    assert not failed and sched.retries > 0
    for q in seqs:
        assert q.finish_reason == "length" and q.output_ids == expected(q.prompt_ids, q.params.max_tokens)
        assert streamed[q.seq_id] == q.output_ids, f"sequence {q.seq_id}: tokens repeated or lost"
    assert sched.blocks.num_free == 64 and not sched.quarantine


@pytest.mark.parametrize("depth,steps", [(0, 1), (1, 1), (2, 1), (2, 3)])
@pytest.mark.parametrize("at", ["launch", "collect"])
@pytest.mark.parametrize("bad", range(4))
def test_a_step_that_raises_for_one_sequence_fails_only_it(depth, steps, at, bad):
    """One sequence makes every step it is in raise (a bad row): it fails, after its one step alone; the others of
    its steps run again alone, rejoin the batches and get their full answers, streamed once, in order."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=96), ())
    engine = Faulty(max(depth, 1), steps, bad=bad, at=at)
    loop = StepLoop(sched, engine, overlap=depth > 0, depth=max(depth, 1), steps=steps)
    seqs = _contained_seqs()
    streamed, failed, _ = _serve_contained(loop, sched, seqs, [0, 0, 0, 3])
    assert failed == {bad}
    for q in seqs:
        if q.seq_id == bad:
            assert q.finish_reason == "error"
            continue
        assert q.finish_reason == "length" and q.output_ids == expected(q.prompt_ids, q.params.max_tokens)
        assert streamed[q.seq_id] == q.output_ids, f"sequence {q.seq_id}: tokens repeated or lost"
    assert sched.blocks.num_free == 64 and not sched.quarantine


@pytest.mark.parametrize("depth,steps", [(0, 1), (2, 3)])
def test_an_engine_that_always_raises_fails_every_request_in_bounded_steps(depth, steps):
    """Every engine call raises: every request fails (none is retried for ever), after a few steps alone
    (BROKEN_AFTER in a row, then the rest of the quarantine at once), and the loop goes idle with every block
    free; requests arriving later fail too."""
    from surge.runtime.scheduler.scheduler import BROKEN_AFTER

    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=96), ())
    engine = Faulty(max(depth, 1), steps, broken=True)
    loop = StepLoop(sched, engine, overlap=depth > 0, depth=max(depth, 1), steps=steps)
    seqs = _contained_seqs() + [Sequence(4 + i, [51 + i, 52], greedy(5)) for i in range(6)]
    streamed, failed, iterations = _serve_contained(loop, sched, seqs, [0] * 8 + [9, 9])
    assert failed == {q.seq_id for q in seqs} and not any(streamed.values())
    # the batch of eight: one failed step, BROKEN_AFTER steps alone (not eight); the two later: one batch, one
    # step alone (the engine is still taken as broken: no step alone has worked since)
    assert BROKEN_AFTER < 8 and engine.raised <= 1 + BROKEN_AFTER + 2
    assert iterations <= 12
    assert sched.blocks.num_free == 64 and not sched.quarantine and not loop.busy


def test_a_sequence_failing_in_every_batch_fails_after_its_retries():
    """An engine whose batched steps always raise and whose steps alone never do: each sequence makes a token's
    progress a retry, and fails once it has been set apart MAX_RETRIES times (bounded, not a token a recompute for
    its whole answer)."""
    from surge.runtime.scheduler.scheduler import MAX_RETRIES

    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=96), ())
    engine = FakeTokenEngine()
    step = engine.step

    def batched_fail(scheduled):
        if len(scheduled) > 1:
            raise RuntimeError("a batch")
        return step(scheduled)

    engine.step = batched_fail
    loop = StepLoop(sched, engine, overlap=False)
    seqs = [Sequence(0, [11, 12, 13], greedy(30)), Sequence(1, [21, 22, 23], greedy(30))]
    streamed, failed, _ = _serve_contained(loop, sched, seqs)
    assert failed == {0, 1}
    for q in seqs:
        assert q.retries == MAX_RETRIES
        assert streamed[q.seq_id] == q.output_ids == expected(q.prompt_ids, len(q.output_ids))
    assert sched.blocks.num_free == 64


def test_an_engine_that_works_again_contains_the_next_failure():
    """After an engine that raised everywhere (its requests failed, BROKEN_AFTER steps alone raising in a row), one
    that works again: a later bad sequence, first in the quarantine, fails alone; the steps that worked since mean
    the engine is not taken as broken, so its neighbour is not failed with it."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                      max_model_len=96), ())
    engine = Faulty(1, 1, broken=True)
    loop = StepLoop(sched, engine, overlap=False)
    _, failed, _ = _serve_contained(loop, sched, _contained_seqs())
    assert failed == {0, 1, 2, 3}
    engine.broken, calls = False, []
    step = engine.step

    def late_fault(scheduled):  # sequence 10 makes steps raise from its third step on
        calls.append(1)
        if len(calls) > 2 and any(s.seq.seq_id == 10 for s in scheduled):
            raise RuntimeError("device error")
        return step(scheduled)

    engine.step = late_fault
    bad, good = Sequence(10, [61, 62, 63], greedy(8)), Sequence(11, [71, 72], greedy(8))
    streamed, failed, _ = _serve_contained(loop, sched, [bad, good])
    assert failed == {10}
    assert streamed[11] == good.output_ids == expected(good.prompt_ids, 8)
    assert sched.blocks.num_free == 64


# -- the quarantine drains beside the batch: the healthy keep their pace, the waiting are admitted ---------------


def _serve_watching(loop, sched, seqs, arrivals, limit=400):
    """_serve_contained, watching each iteration that starts with a quarantine and does not raise; seqs[i] is added
    before iteration arrivals[i], or (None) the first iteration that starts with a quarantine. -> (tokens streamed
    by seq id, failed seq ids, one (quarantined ids, ids running outside the quarantine, ids that advanced) per such
    iteration, the first two at its start; advanced: handed a token, or launched a step whose token is read back in
    a later iteration (overlapped steps))."""
    streamed, failed, watched = {q.seq_id: [] for q in seqs}, set(), []
    late = [q for q, at in zip(seqs, arrivals) if at is None]
    for it in range(limit):
        for q, at in zip(seqs, arrivals):
            if at == it:
                sched.add(q)
        if late and sched.quarantine:
            for q in late:
                sched.add(q)
            late = []
        if not loop.busy and not late and it >= max(a for a in arrivals if a is not None):
            return streamed, failed, watched
        held = {q.seq_id for q in sched.quarantine}
        outside = {q.seq_id for q in sched.running} - held
        results, raised = step_or_contain(loop, sched, failed)
        if raised:
            held = None  # a step that raised: its neighbours lose this iteration
        for r in results:
            for sid, token in r.tokens.items():
                streamed[sid].append(token)
        if held:
            advanced = {sid for r in results for sid in r.tokens}
            advanced |= {q.seq_id for q in sched.running if PLACEHOLDER in q.token_ids}
            watched.append((held, outside, advanced))
        sched.blocks.check()
    raise AssertionError(f"the loop never went idle: running {[q.seq_id for q in sched.running]}, failed {failed}")


def check_quarantine_beside_the_batch(watched, seqs, arrivals):
    """While the quarantine holds a sequence: every sequence running outside it advances each iteration (a token,
    or a launched step); the sequences arriving once it holds one (arrival None) are admitted beside it (advanced
    in an iteration that started with them waiting and a quarantine); and the quarantine's head runs every
    iteration, however busy the batch (it drains in as many iterations as it held sequences)."""
    assert any(outside for _, outside, _ in watched), "no sequence ran beside the quarantine"
    for i, (held, outside, given) in enumerate(watched):
        assert outside <= given, f"iteration {i} beside the quarantine {held}: {outside - given} did not advance"
    late = [q.seq_id for q, at in zip(seqs, arrivals) if at is None]
    assert late
    for sid in late:
        assert any(sid in given and sid not in held | outside for held, outside, given in watched), \
            f"sequence {sid}, arriving while the quarantine held, was not admitted beside it"
    assert len(watched) <= max(len(held) for held, *_ in watched)


@pytest.mark.parametrize("depth,steps", [(0, 1), (1, 1), (2, 1), (2, 3)])
@pytest.mark.parametrize("at", ["launch", "collect"])
@pytest.mark.parametrize("bad,arrivals", [(4, [0, 0, 0, 0, 3, None]), (2, [0, 0, 0, 0, None, None])])
def test_the_batch_keeps_decoding_while_the_quarantine_drains(depth, steps, at, bad, arrivals):
    """A bad sequence (every step it is in raises) late in the quarantine: while the quarantine drains, a step
    alone at a time, the sequences that rejoined the batch and the ones arriving meanwhile advance every iteration
    (a token, or a launched step read back at the next; they used to wait for the whole quarantine); the bad one
    still fails alone, and every other gets its full answer, streamed once, in order, every block back."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                                      max_model_len=96), ())
    engine = Faulty(max(depth, 1), steps, bad=bad, at=at)
    loop = StepLoop(sched, engine, overlap=depth > 0, depth=max(depth, 1), steps=steps)
    seqs = _contained_seqs() + [Sequence(4, [51, 52, 53, 54], greedy(10)), Sequence(5, [61, 62, 63], greedy(12))]
    streamed, failed, watched = _serve_watching(loop, sched, seqs, arrivals)
    assert failed == {bad} and seqs[bad].finish_reason == "error"
    check_quarantine_beside_the_batch(watched, seqs, arrivals)
    for q in seqs:
        if q.seq_id != bad:
            assert q.finish_reason == "length" and q.output_ids == expected(q.prompt_ids, q.params.max_tokens)
            assert streamed[q.seq_id] == q.output_ids, f"sequence {q.seq_id}: tokens repeated or lost"
    assert sched.blocks.num_free == 64 and not sched.quarantine


@pytest.mark.parametrize("policy,prefix_caching,prompt,neighbour,before", [
    ("fcfs", False, 13, 5, 3), ("fcfs", True, 13, 5, 3), ("priority", False, 5, 4, 2), ("priority", True, 5, 6, 2)])
def test_the_batch_never_preempts_a_context_recomputed_alone(policy, prefix_caching, prompt, neighbour, before):
    """Five KV blocks and a two-token budget: a sequence set apart (Scheduler.isolate, as contain() does; the
    lowest priority, the newest running: the batch's victim of choice) recomputes its context alone over several
    steps, while its neighbour decodes beside it and needs a block that is not free. The batch preempts among its
    own (here its only sequence), never the sequence recomputed alone (which would lose its recompute, and be
    queued twice); every block is accounted for at each step, both answers are the ones a run without the failure
    gives, and every block comes back."""
    from tests.unit.test_scheduler import FakeTokenEngine

    sched = Scheduler(SchedulerConfig(num_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=2,
                                      max_model_len=20, prefix_caching=prefix_caching, policy=policy), ())
    loop = StepLoop(sched, FakeTokenEngine(), overlap=False)
    alone = Sequence(0, list(range(11, 11 + prompt)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                      priority=1))
    other = Sequence(1, list(range(31, 31 + neighbour)), greedy(12))
    sched.add(alone)
    sched.add(other)
    while len(alone.output_ids) < before:
        loop.step()
    sched.isolate(alone)
    schedule, squeezed = sched.schedule, []

    def batch():  # the batch's step, noting a preemption made while the quarantine's head is mid-recompute
        head = sched.quarantine[0] if sched.quarantine else None
        mid, preemptions = head is not None and head.status is SeqStatus.RUNNING, sched.preemptions
        out = schedule()
        if mid and sched.preemptions > preemptions:
            squeezed.append(head.seq_id)
        return out

    sched.schedule = batch
    for _ in range(100):
        if not loop.busy:
            break
        loop.step()
        sched.blocks.check()
    assert squeezed, "the batch must run short of blocks while a context is recomputed alone"
    assert alone.finish_reason == other.finish_reason == "length"
    assert alone.output_ids == expected(alone.prompt_ids, 6) and other.output_ids == expected(other.prompt_ids, 12)
    assert sched.blocks.num_free == 5 and not sched.quarantine and not sched.waiting
