"""The generation scheduler alone (no torch, no model): blocks, admission, budget, preemption, prefix cache.

A fake engine "computes" a step by checking that every scheduled token's position has a block,
and samples a token that is a function of the whole sequence so far, so any scheduling
mistake (a lost token, a wrong order after preemption) changes the outputs.
"""

from __future__ import annotations

import random

import pytest

from surge.runtime.scheduler import BlockManager, SamplingParams, Scheduler, SchedulerConfig, Sequence, SeqStatus
from surge.runtime.scheduler.sequence import PLACEHOLDER
from tests.loop_driver import drive


def fake_token(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 2654435761) % 997


def run(sched: Scheduler, seqs, *, check=None, max_steps=10_000):
    steps = []
    for _ in range(max_steps):
        if not sched.has_work:
            break
        scheduled = sched.schedule()
        assert scheduled, "a step with work scheduled nothing"
        tokens = sum(s.num_tokens for s in scheduled)
        assert tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        for s in scheduled:
            # every computed position has a block, and blocks are not shared unless cached
            assert len(s.seq.block_table) * sched.config.block_size >= s.start + s.num_tokens
            assert s.start == s.seq.num_computed
        samples = {s.seq.seq_id: fake_token(s.seq.token_ids) for s in scheduled if s.sample}
        sched.update(scheduled, samples)
        sched.blocks.check()
        steps.append(scheduled)
        if check:
            check(sched, scheduled)
    assert not sched.has_work
    return steps


def expected(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_token(toks))
    return toks[len(prompt):]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_block_manager_prefix_sharing_and_eviction_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = Sequence(1, list(range(10)), greedy(1))
    bm.allocate_prefix(a)
    assert a.num_computed == 0 and bm.ensure(a, 10) and len(a.block_table) == 3
    a.num_computed = 10
    bm.commit(a)
    assert len(a.block_hashes) == 2  # two full blocks named
    b = Sequence(2, list(range(8)) + [99, 98, 97], greedy(1))
    bm.allocate_prefix(b)
    assert b.block_table == a.block_table[:2] and b.num_computed == 8  # shared head
    bm.release(a)
    assert bm.num_free == 6 - 2  # the shared blocks stay referenced by b
    bm.release(b)
    bm.check()
    # a prompt that is exactly cached still computes its last token
    c = Sequence(3, list(range(8)), greedy(1))
    bm.allocate_prefix(c)
    assert c.num_computed == 4
    bm.release(c)
    # eviction: allocating every block drops the cached hashes
    d = Sequence(4, [7] * 24, greedy(1))
    bm.allocate_prefix(d)
    assert bm.ensure(d, 24) and not bm.cached
    assert not bm.ensure(Sequence(5, [1], greedy(1)), 1)


def test_outputs_are_right_with_joins_leaves_and_chunked_prefill():
    rng = random.Random(0)
    cfg = SchedulerConfig(num_blocks=200, block_size=4, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=512)
    sched = Scheduler(cfg)
    seqs = [Sequence(i, [rng.randrange(1000) for _ in range(rng.randint(1, 30))], greedy(rng.randint(1, 12)))
            for i in range(10)]
    for s in seqs:
        sched.add(s)
    chunked = []

    def check(sched, scheduled):
        if any(s.num_tokens > 1 and not s.sample for s in scheduled):
            chunked.append(1)

    run(sched, seqs, check=check)
    assert chunked, "a 30-token prompt over a budget of 8 must be split"
    for s in seqs:
        assert s.status is SeqStatus.FINISHED and s.finish_reason == "length"
        assert s.output_ids == expected(s.prompt_ids, s.params.max_tokens)
    assert sched.blocks.num_free == cfg.num_blocks


def test_admission_waits_for_free_blocks_and_preemption_keeps_outputs():
    cfg = SchedulerConfig(num_blocks=12, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    sched = Scheduler(cfg, eos_token_ids=())
    rng = random.Random(1)
    seqs = [Sequence(i, [rng.randrange(1000) for _ in range(10)], greedy(14)) for i in range(5)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    # 10 prompt tokens = 3 blocks each: only 4 of 5 fit in 12 blocks
    assert len(first) == 4 and len(sched.waiting) == 1
    sched.update(first, {s.seq.seq_id: fake_token(s.seq.token_ids) for s in first if s.sample})
    run(sched, seqs)
    assert sched.preemptions > 0, "growing sequences must run out of blocks"
    for s in seqs:
        assert s.output_ids == expected(s.prompt_ids, 14)
    assert sched.blocks.num_free == cfg.num_blocks


def test_prefix_cache_hits_for_a_shared_system_prompt():
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    sched = Scheduler(cfg)
    system = list(range(100, 120))  # 5 full blocks
    first = Sequence(0, system + [1, 2], greedy(3))
    sched.add(first)
    run(sched, [first])
    later = [Sequence(i, system + [i, i + 1, i + 2], greedy(3)) for i in range(1, 4)]
    for s in later:
        sched.add(s)
    run(sched, later)
    assert all(s.num_cached_prompt == 20 for s in later)
    assert sched.blocks.hit_tokens == 60
    for s in [first, *later]:
        assert s.output_ids == expected(s.prompt_ids, 3)


def test_abort_frees_blocks_at_once_and_stop_tokens_finish():
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    sched = Scheduler(cfg, eos_token_ids=(5,))
    a = Sequence(1, [1, 2, 3, 4, 5, 6], greedy(50))
    b = Sequence(2, [9, 9], SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=(fake_token([9, 9]),)))
    sched.add(a)
    sched.add(b)
    s1 = sched.schedule()
    fin = sched.update(s1, {s.seq.seq_id: fake_token(s.seq.token_ids) for s in s1})
    assert [f.seq for f in fin] == [b] and b.finish_reason == "stop"
    assert sched.blocks.num_free < cfg.num_blocks
    sched.abort(a)
    assert a.status is SeqStatus.FINISHED and sched.blocks.num_free == cfg.num_blocks and not sched.has_work


def test_max_model_len_and_oversized_prompts():
    cfg = SchedulerConfig(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=12)
    sched = Scheduler(cfg)
    with pytest.raises(ValueError):
        sched.add(Sequence(1, list(range(12)), greedy(2)))
    s = Sequence(2, list(range(8)), greedy(100))
    sched.add(s)
    run(sched, [s])
    assert s.finish_reason == "length" and s.num_tokens == 12
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_sampling_params_validation_and_keys():
    from surge.errors import InvalidInput

    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop": ("",)},
                {"presence_penalty": 3}, {"logprobs": 21}):
        with pytest.raises(InvalidInput):
            SamplingParams(**bad)
    assert SamplingParams(temperature=0, seed=1).key() == SamplingParams(temperature=0, seed=2).key()
    assert SamplingParams(seed=1).key() != SamplingParams(seed=2).key()
    assert SamplingParams(seed=1).deterministic and not SamplingParams().deterministic


class _Out:
    def __init__(self, token):
        self.token = token


class FakeEngine:
    """Launched steps as the GPU engine runs them: a sequence's input token may be a placeholder, then
    it must come from the previous launch's output (what the device gathers); with several launches
    in flight, older tokens of the sequence may still be placeholders on the host too (the "device"
    here remembers what it sampled). With `steps` > 1 a launch runs up to that many decode steps,
    each fed by the one before, and checks that the blocks of every position it computes are there."""

    def __init__(self, depth=1, steps=1, block_size=4):
        self.launched = 0
        self.depth = depth
        self.steps = steps
        self.block_size = block_size
        self.multi = 0  # launches of more than one step
        self.sampled = {}  # (seq_id, index in token_ids) -> token sampled by a launch

    def can_launch(self, scheduled):
        return bool(scheduled) and all(s.num_tokens == 1 and s.sample and s.seq.fast for s in scheduled)

    def launch_steps(self, scheduled):
        return self.steps

    def _token(self, s, prev=None):
        sid = s.seq.seq_id
        toks = s.seq.token_ids[: s.start + s.num_tokens]
        holes = [i for i, t in enumerate(toks) if t == PLACEHOLDER]
        assert all(i >= len(toks) - self.depth * self.steps for i in holes), "only launched tokens are in flight"
        if toks and toks[-1] == PLACEHOLDER:
            assert prev is not None and sid in prev, "a placeholder input must be in the previous launch"
            assert prev[sid][-1] == self.sampled[sid, len(toks) - 1]
        toks = [self.sampled[sid, i] if t == PLACEHOLDER else t for i, t in enumerate(toks)]
        return fake_token(toks)

    def launch(self, scheduled, prev, steps=1):
        assert steps <= self.steps
        self.launched += 1
        self.multi += steps > 1
        out = {}
        for s in scheduled:
            sid = s.seq.seq_id
            assert len(s.seq.block_table) * self.block_size >= s.start + steps, "a launched position has no block"
            toks = [self.sampled[sid, i] if t == PLACEHOLDER else t
                    for i, t in enumerate(s.seq.token_ids[: s.start + s.num_tokens])]
            first = self._token(s, prev)
            got = [first]
            for _ in range(steps - 1):  # the device's next step: its input is the token just sampled
                toks.append(got[-1])
                got.append(fake_token(toks))
            for j, t in enumerate(got):
                self.sampled[sid, s.start + s.num_tokens + j] = t
            out[sid] = got
        return out

    def collect(self, handle):
        assert all(len(v) == 1 for v in handle.values()), "collect() reads one-step launches"
        return {k: _Out(v[0]) for k, v in handle.items()}

    def step(self, scheduled):
        return {s.seq.seq_id: _Out(self._token(s)) for s in scheduled if s.sample}


class FakeTokenEngine(FakeEngine):
    """Reads launched steps back as plain token lists (DecoderEngine.collect_tokens): the loop then
    resolves them with Scheduler.resolve_rows."""

    def collect_tokens(self, handle):
        rows = list(handle.values())  # in the launched (scheduled) order
        return [r[j] for j in range(len(rows[0])) for r in rows]  # step-major


def _loop_run(overlap, seed, abort_at=None, engine_cls=FakeEngine, depth=1, steps=1, early=False):
    from surge.runtime.scheduler.overlap import StepLoop

    rng = random.Random(seed)
    cfg = SchedulerConfig(num_blocks=56, block_size=4, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96)
    sched = Scheduler(cfg, eos_token_ids=tuple(range(5, 997, 29)))  # ~3% of tokens end the ones that mind EOS
    stops = tuple(range(0, 997, 13))  # ~8% of tokens stop a sequence that has them as stop tokens
    seqs = []
    for i in range(14):
        prompt = [rng.randrange(5, 997) for _ in range(rng.randrange(1, 30))]
        kind = i % 4
        host = i in (3, 10)  # logprobs: not fast, the host path (short, so that chains form around them)
        params = SamplingParams(max_tokens=rng.randrange(1, 6 if host else 40), temperature=0.0,
                                stop_token_ids=stops if kind == 1 else (), ignore_eos=kind != 2,
                                logprobs=0 if host else None)
        seqs.append(Sequence(i, prompt, params))
    arrivals = sorted(rng.choice((0, 0, 15, 30)) + rng.randrange(0, 3) for _ in seqs)  # in bursts
    engine = engine_cls(depth, steps)
    loop = StepLoop(sched, engine, overlap=overlap, depth=depth, steps=steps)

    def abort(step):
        if step == abort_at:
            for s in seqs[:3]:
                sched.abort(s)

    streamed = drive(loop, sched, seqs, arrivals, abort, early=early)
    assert sched.blocks.num_free == cfg.num_blocks
    return seqs, streamed, loop, sched


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("engine_cls", [FakeEngine, FakeTokenEngine])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_steps_give_the_synchronous_results(seed, engine_cls, depth):
    """Stops found `depth` steps late, sequences joining a chain, host-path sequences breaking it,
    preemption between chains: the tokens, finish reasons and streamed tokens are those of the
    synchronous loop (and of a sequence computed alone), with 1 to 3 launched steps in flight."""
    a, sa, _, sched_a = _loop_run(False, seed)
    b, sb, loop, sched_b = _loop_run(True, seed, engine_cls=engine_cls, depth=depth)
    assert loop.overlapped >= 20, "the run must overlap steps"
    for x, y in zip(a, b):
        assert y.output_ids == x.output_ids and y.finish_reason == x.finish_reason, y.seq_id
        assert PLACEHOLDER not in y.token_ids
        assert sb[y.seq_id] == y.output_ids  # each token streamed once, in order
        assert x.output_ids == expected(x.prompt_ids, len(x.output_ids))
    assert any(s.finish_reason == "stop" for s in b) and any(s.finish_reason == "length" for s in b)
    assert any(s.finish_reason == "stop" and not s.params.ignore_eos and s.output_ids[-1] in sched_b.eos for s in b)
    # aborted mid-chain: blocks free at once, nothing else changes
    c, sc, _, _ = _loop_run(True, seed, abort_at=12, engine_cls=engine_cls, depth=depth)
    for x, y in zip(a[3:], c[3:]):
        assert y.output_ids == x.output_ids
    for y in c[:3]:
        assert sc[y.seq_id] == [t for t in y.output_ids if t != PLACEHOLDER][: len(sc[y.seq_id])]


@pytest.mark.parametrize("depth,steps", [(1, 2), (2, 4), (3, 3), (2, 8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_step_launches_give_the_synchronous_results(seed, depth, steps):
    """Launches of several decode steps (each step fed by the one before on the "device"): stops found
    inside a launch drop the launch's rest, launches never pass max_tokens, blocks are there for every
    position launched, and the tokens, finish reasons and streamed tokens are the synchronous loop's."""
    a, sa, _, _ = _loop_run(False, seed)
    b, sb, loop, sched_b = _loop_run(True, seed, engine_cls=FakeTokenEngine, depth=depth, steps=steps)
    assert loop.engine.multi >= 5, "the run must launch several steps at once"
    assert loop.steps > loop.engine.launched, "more decode steps than launches"
    for x, y in zip(a, b):
        assert y.output_ids == x.output_ids and y.finish_reason == x.finish_reason, y.seq_id
        assert len(y.output_ids) <= y.params.max_tokens
        assert PLACEHOLDER not in y.token_ids
        assert sb[y.seq_id] == y.output_ids  # each token streamed once, in order
    assert any(s.finish_reason == "stop" for s in b) and any(s.finish_reason == "length" for s in b)
    c, sc, _, _ = _loop_run(True, seed, abort_at=12, engine_cls=FakeTokenEngine, depth=depth, steps=steps)
    for x, y in zip(a[3:], c[3:]):
        assert y.output_ids == x.output_ids
    for y in c[:3]:
        assert sc[y.seq_id] == [t for t in y.output_ids if t != PLACEHOLDER][: len(sc[y.seq_id])]


def test_arrivals_while_launches_drain_join_the_prefill_step(monkeypatch):
    """Sequences that arrive while the loop drains its launches in flight (before a prefill step) are
    admitted into that step where its token budget and max_num_seqs leave room (some seeds' bursts
    fill it), and the tokens, finish reasons and streamed tokens stay the synchronous loop's, with
    aborts too."""
    from surge.runtime.scheduler.overlap import StepLoop

    joined = []  # sequences added during a step (by its refresh) and admitted in that same step
    add, step = Scheduler.add, StepLoop.step
    during: list | None = None

    def recording_add(self, seq):
        if during is not None:
            during.append(seq)
        return add(self, seq)

    def flagged_step(self, *a):
        nonlocal during
        during = []
        try:
            return step(self, *a)
        finally:
            joined.extend(q.seq_id for q in during if q.scheduled_at)
            during = None

    monkeypatch.setattr(Scheduler, "add", recording_add)
    monkeypatch.setattr(StepLoop, "step", flagged_step)
    for seed in range(6):
        a, _, _, _ = _loop_run(False, seed)
        late, _, loop_late, _ = _loop_run(True, seed, engine_cls=FakeTokenEngine, depth=2, steps=4)
        b, sb, loop, _ = _loop_run(True, seed, engine_cls=FakeTokenEngine, depth=2, steps=4, early=True)
        for x, y, z in zip(a, b, late):
            assert y.output_ids == x.output_ids == z.output_ids and y.finish_reason == x.finish_reason, y.seq_id
            assert sb[y.seq_id] == y.output_ids
        c, sc, _, _ = _loop_run(True, seed, abort_at=12, engine_cls=FakeTokenEngine, depth=2, steps=4, early=True)
        for x, y in zip(a[3:], c[3:]):
            assert y.output_ids == x.output_ids
        for y in c[:3]:
            assert sc[y.seq_id] == [t for t in y.output_ids if t != PLACEHOLDER][: len(sc[y.seq_id])]
    assert len(joined) >= 3, "arrivals during a drain must have joined the step after it"


def test_admit_adds_what_fits_the_step_and_nothing_after_a_preemption():
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_num_seqs=3, max_num_batched_tokens=10, max_model_len=32)
    sched = Scheduler(cfg)
    p = SamplingParams(max_tokens=4, temperature=0.0)
    sched.add(Sequence(0, list(range(10, 16)), p))
    first = sched.schedule()
    assert [(s.seq.seq_id, s.num_tokens) for s in first] == [(0, 6)]
    sched.add(Sequence(1, list(range(20, 27)), p))  # 7 tokens: 4 fit the budget left (chunked)
    sched.add(Sequence(2, [30, 31], p))
    both = sched.admit(first)
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in both] == [(0, 0, 6), (1, 0, 4)]
    assert [s.seq_id for s in sched.running] == [0, 1] and [s.seq_id for s in sched.waiting] == [2]
    # a schedule() that preempts admits nothing more
    cfg = SchedulerConfig(num_blocks=3, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=32)
    sched = Scheduler(cfg)
    x, y = Sequence(0, list(range(10, 18)), p), Sequence(1, list(range(20, 24)), p)
    sched.add(x)
    sched.add(y)
    sched.update(sched.schedule(), {0: 1, 1: 2})  # 2 + 1 blocks: all of them
    out = sched.schedule()  # x's 9th token needs a third block: y is preempted
    assert sched.preemptions == 1 and [s.seq.seq_id for s in out] == [0]
    assert sched.admit(out) == out and list(sched.waiting) == [y]


def test_launch_steps_stop_at_max_tokens_and_max_model_len():
    """A launch runs no step past any of its sequences' max_tokens or max_model_len, and at least one."""
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=20)
    sched = Scheduler(cfg)
    a = Sequence(1, list(range(10, 15)), greedy(9))  # 5 prompt tokens: max_tokens binds
    b = Sequence(2, list(range(10, 22)), greedy(50))  # 12 prompt tokens: max_model_len (20) binds
    for q in (a, b):
        sched.add(q)
    sched.update(sched.schedule(), {1: 30, 2: 31})  # one token each
    scheduled = sched.schedule()
    assert sched.launch_steps(scheduled[:1], 16) == 8  # a: 8 more tokens allowed
    assert sched.launch_steps(scheduled[1:], 16) == 7  # b: 13 tokens, 7 more fit under 20
    assert sched.launch_steps(scheduled, 16) == 7 and sched.launch_steps(scheduled, 3) == 3
    assert sched.decode_fits(7)
    sched.reserve(scheduled, 7)
    assert all(len(s.seq.block_table) * 4 >= s.start + 7 for s in scheduled)
    sched.advance(scheduled, 7)
    assert b.draining and not a.draining and b.num_computed == 19 and b.token_ids[-7:] == [PLACEHOLDER] * 7
    a.output_ids[-7:] = a.token_ids[-7:] = [40] * 7  # (as resolve_rows would)
    assert sched.launch_steps(sched.schedule(), 16) == 1  # a has one token left


def test_blocks_of_tokens_in_flight_are_not_named():
    """Depth 2: step k is read back while k+1 and k+2 run, so the newest computed input (k+1's token)
    is still a placeholder. The block it completes is not hashed into the prefix cache until the token
    is known; then it is, with the hash a sequence that had the token from the start gets."""
    cfg = SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    sched = Scheduler(cfg)
    seq = Sequence(1, list(range(11, 20)), greedy(10))  # 9 prompt tokens
    sched.add(seq)
    first = sched.schedule()
    sched.update(first, {1: 20})  # 9 computed, token 20 at index 9
    steps = []
    for _ in range(3):  # steps 1, 2, 3 launched (step 3 before step 1 is read back)
        steps.append(sched.schedule())
        sched.advance(steps[-1])
    assert seq.num_computed == 12 and seq.token_ids[10:] == [PLACEHOLDER] * 3
    sched.resolve_rows(steps[0], [21])  # step 1's token (index 10); index 11 is step 2's, in flight
    assert len(seq.block_hashes) == 2, "block [8..11] holds a token still on the device"
    sched.resolve_rows(steps[1], [22])
    assert len(seq.block_hashes) == 3
    fresh = BlockManager(16, 4, prefix_caching=True)
    other = Sequence(2, list(range(11, 23)) + [7], greedy(1))
    other.num_computed = 12
    fresh.ensure(other, 12)
    fresh.commit(other)
    assert other.block_hashes == seq.block_hashes


def _prio(n, priority):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, priority=priority)


def test_priority_policy_orders_the_waiting_and_keeps_outputs():
    """Under the priority policy sequences are admitted by (priority, arrival), whatever order they came in;
    preempted ones go back to their place; every output is still the sequence's own. Under fcfs the same
    priorities change nothing: arrival order."""
    rng = random.Random(5)
    prios = [3, 0, 2, 0, -1, 3, 1, 2]
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(3, 12))] for _ in prios]
    for policy in ("priority", "fcfs"):
        cfg = SchedulerConfig(num_blocks=14, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                              max_model_len=512, policy=policy)
        sched = Scheduler(cfg)
        seqs = [Sequence(i, p, _prio(10, pr), arrival=float(i)) for i, (p, pr) in enumerate(zip(prompts, prios))]
        for s in seqs:
            sched.add(s)
        admitted = []

        def check(sched, scheduled):
            for s in scheduled:
                if s.seq.seq_id not in admitted:
                    admitted.append(s.seq.seq_id)

        run(sched, seqs, check=check)
        want = sorted(range(len(prios)), key=lambda i: (prios[i], i)) if policy == "priority" else list(range(8))
        assert admitted == want, policy
        for s in seqs:
            assert s.output_ids == expected(s.prompt_ids, 10)
        assert sched.blocks.num_free == cfg.num_blocks


def test_priority_policy_preempts_the_lowest_priority_first():
    """Blocks run out while four sequences decode: the priority policy takes them from the running sequence
    of the lowest priority (the highest value; the newest among equals), fcfs from the newest; a preempted
    sequence waits at its priority's place (ahead of later arrivals of its priority) and its output is kept."""
    for policy in ("priority", "fcfs"):
        cfg = SchedulerConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                              max_model_len=512, policy=policy)
        sched = Scheduler(cfg)
        prios = [5, 1, 0, 1]  # the oldest has the lowest priority and is admitted before the others arrive
        seqs = [Sequence(i, [i + 1] * 8, _prio(12, pr), arrival=float(i)) for i, pr in enumerate(prios)]
        for s in seqs[:2]:
            sched.add(s)
        first = sched.schedule()
        sched.update(first, {s.seq.seq_id: fake_token(s.seq.token_ids) for s in first if s.sample})
        for s in seqs[2:]:
            sched.add(s)
        victims = []

        def check(sched, scheduled):
            for s in sched.waiting:
                if s.preemptions and s.seq_id not in victims:
                    victims.append(s.seq_id)

        run(sched, seqs, check=check)
        assert victims, "4 x (8 + 12) tokens do not fit 12 blocks of 4"
        assert victims[0] == (0 if policy == "priority" else 3), (policy, victims)
        for s in seqs:
            assert s.output_ids == expected(s.prompt_ids, 12)


def test_a_preempted_sequence_waits_at_its_priority():
    cfg = SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=4, policy="priority")
    sched = Scheduler(cfg)
    a, b, c = (Sequence(i, [1, 2, 3], _prio(4, pr), arrival=float(i)) for i, pr in enumerate([1, 1, 0]))
    for s in (b, c):
        sched.add(s)
    sched._preempt(a)  # an older sequence of priority 1 comes back: after c (priority 0), before b
    assert [s.seq_id for s in sched.waiting] == [2, 0, 1]
    with pytest.raises(ValueError, match="scheduling policy"):
        SchedulerConfig(policy="lifo")
    assert _prio(4, 7).key() == _prio(4, 0).key(), "a priority does not change the answer (the cache's key)"


def test_blocks_touched_while_launches_are_in_flight_are_not_settled():
    """BlockManager.settled(blocks, since): false for a block freed, or named from a launched step's tokens
    (its last K/V still to be written by the launch behind), after the clock read `since`; naming from a
    synchronous step's tokens (their K/V written) leaves a block settled."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(0, [5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    bm.allocate_prefix(a)
    assert bm.ensure(a, 5) and len(a.block_table) == 2
    a.num_computed = 5
    since = bm.clock
    bm.commit(a)  # a synchronous step computed the first block: named, settled
    assert a.block_hashes and bm.settled(a.block_table, since)
    b = Sequence(1, [1, 2, 3], SamplingParams(max_tokens=4))
    bm.allocate_prefix(b)
    assert bm.ensure(b, 8)
    b.token_ids += [4, 5, 6, 7, 8]
    b.num_computed = 8
    since = bm.clock
    bm.commit(b, launched=True)  # named from a launched step's tokens
    first, second = b.block_table
    assert not bm.settled([first], since) and not bm.settled([second], since)
    assert bm.settled(a.block_table, since)
    since = bm.clock
    assert bm.settled(b.block_table, since)
    bm.release(a)
    freed = [blk for blk in bm.free if bm.touched[blk] > since]
    assert len(freed) == 2 and not bm.settled(freed[:1], since) and bm.settled(b.block_table, since)
    assert bm.settled(freed, bm.clock)


def test_a_sequence_longer_than_the_whole_kv_cache_ends_instead_of_spinning():
    """max_model_len beyond the KV cache (num_blocks * block_size): a lone sequence that outgrows the cache
    used to preempt itself and never be admitted again (has_work forever, the waiting queue behind it
    starved). It ends with "length" where the cache is full, as at max_model_len."""
    cfg = SchedulerConfig(num_blocks=2, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    sched = Scheduler(cfg)
    s = Sequence(1, [5, 6, 7], greedy(20))
    t = Sequence(2, [8, 9], greedy(3))
    sched.add(s)
    sched.add(t)
    run(sched, [s, t], max_steps=200)
    assert s.finish_reason == "length" and s.num_tokens == 8
    assert s.output_ids == expected([5, 6, 7], 5) and t.output_ids == expected([8, 9], 3)
    assert sched.blocks.num_free == 2
