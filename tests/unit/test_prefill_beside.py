"""Prompts prefilled beside the decode launches in flight (runtime/scheduler/overlap.py's `beside`,
DecoderEngine.prefill_beside), on the CPU: the graphs are the harness's eager replays
(tests/unit/test_decoder_graph_buffers.py), and `Behind` makes the "device" run behind the host as a GPU
does: a launch's work runs only when it is read back, while a step beside it runs at once. So a block the
host freed (a sequence found stopped) but a launch behind still writes is a real hazard here, as on a GPU."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from surge.engines.decoder import DecoderEngine  # noqa: E402
from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence  # noqa: E402
from surge.runtime.scheduler.overlap import StepLoop  # noqa: E402
from surge.runtime.scheduler.step import ScheduledSeq  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402
from tests.loop_driver import drive  # noqa: E402
from tests.unit.test_decoder_graph_buffers import _host_graphs, _host_row_graphs  # noqa: E402


class _Pending:
    def __init__(self, scheduled, prev, steps):
        self.scheduled, self.prev, self.steps, self.real = scheduled, prev, steps, None


class Behind:
    """The engine with its launches run when they are read back (in launch order), on the sequences as they
    were at launch (their tokens, positions and block tables then): what a GPU does with queued work."""

    def __init__(self, engine):
        self.engine = engine
        self.queue: list[_Pending] = []
        self.ran_behind = 0  # launches that ran after a step beside them had run

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def launch(self, scheduled, prev, steps=1):
        snap = []
        for s in scheduled:
            q = copy.copy(s.seq)
            q.token_ids, q.block_table = list(q.token_ids), list(q.block_table)
            snap.append(ScheduledSeq(q, s.start, s.num_tokens, s.sample))
        self.queue.append(_Pending(snap, prev, steps))
        return self.queue[-1]

    def _run(self, upto: _Pending) -> None:
        while upto.real is None:
            p = self.queue.pop(0)
            prev = p.prev.real if p.prev is not None else None
            p.real = self.engine.launch(p.scheduled, prev, p.steps) if p.steps > 1 else \
                self.engine.launch(p.scheduled, prev)

    def collect_tokens(self, handle):
        self._run(handle)
        return self.engine.collect_tokens(handle.real)

    def collect(self, handle):
        self._run(handle)
        return self.engine.collect(handle.real)

    def prefill_beside(self, scheduled):
        self.ran_behind += len(self.queue)
        return self.engine.prefill_beside(scheduled)

    def step(self, scheduled):
        assert not self.queue, "a synchronous step runs after the launches in flight"
        return self.engine.step(scheduled)


def _engine(d, num_blocks=96, steps=3):
    """A CPU engine whose decode graphs (multi-step) and row graphs are the harness's replays; returns
    (engine, the harness's attention to patch in)."""
    engine = DecoderEngine(d, num_blocks=num_blocks, block_size=4, max_num_seqs=6)
    attention = _host_graphs(engine, 6, steps=steps)
    _host_row_graphs(engine, 12, limit=24)
    return engine, attention


def _watched(d, monkeypatch):
    """(the harness engine behind `Behind`, the list of each beside step's sequence ids)."""
    from surge.engines.decoder import model as model_mod

    engine, attention = _engine(d)
    monkeypatch.setattr(model_mod, "paged_attention_torch", attention)
    beside = []
    monkeypatch.setattr(engine, "prefill_beside", lambda sc: beside.append([s.seq.seq_id for s in sc])
                        or DecoderEngine.prefill_beside(engine, sc))
    return Behind(engine), beside


def _greedy(hf, prompt, n):
    return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()


def _stopper(hf, g, earliest: int):
    """(prompt, its 20-token greedy answer, the index of the answer's stop): a 7-token prompt whose answer has a
    token first seen at an index in [earliest, 12), which as a stop token ends it there."""
    for _ in range(50):
        stopper = torch.randint(3, 300, (7,), generator=g).tolist()
        answer = _greedy(hf, stopper, 20)
        stop = next((i for i in range(earliest, 12) if answer[i] not in answer[:i]), None)
        if stop is not None:
            return stopper, answer, stop
    raise AssertionError("no prompt with a stop in range")


def _scheduler(num_blocks=96):
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                                     max_model_len=128), ())


@pytest.mark.parametrize("kind", ["qwen2", "gpt2", "llama"])
def test_prompts_joining_launches_are_prefilled_beside_them(tmp_path, monkeypatch, kind):
    """Prompts arriving while multi-step launches are in flight are prefilled and sampled at once, beside those
    launches (which run later, as on a GPU), and join the next launch: every sequence gets transformers' greedy
    tokens, a stop found inside a launch included; a prompt longer than the row graphs take waits for the
    launches and runs synchronously."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    d = build_model(kind, tmp_path / kind, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    lengths = (9, 14, 6, 11, 5, 30, 7, 10)  # the 30-token prompt is over the row graphs' 24 tokens
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    lens = [30, 26, 12, 9, 14, 11, 16, 8]
    refs = [_greedy(hf, p, n) for p, n in zip(prompts, lens)]
    stop_at = {1: 13}
    dev, beside = _watched(d, monkeypatch)
    sched = _scheduler()
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=(refs[i][stop_at[i]],) if i in stop_at else ()))
            for i, (p, n) in enumerate(zip(prompts, lens))]
    loop = StepLoop(sched, dev, overlap=True, depth=2, steps=3, beside=True)
    streamed = drive(loop, sched, seqs, [0, 0, 0, 3, 4, 6, 9, 11])
    for s, ref in zip(seqs, refs):
        want = ref[:ref.index(ref[stop_at[s.seq_id]]) + 1] if s.seq_id in stop_at else ref
        assert s.output_ids == want == streamed[s.seq_id], f"prompt {s.seq_id}"
    joined = {sid for b in beside for sid in b}
    assert {3, 4, 6, 7} <= joined and 5 not in joined, beside
    assert loop.beside_steps == len(beside) and dev.ran_behind >= len(beside), "launches were behind each"
    assert sched.blocks.num_free == 96


def test_blocks_launches_in_flight_may_write_are_not_prefilled_beside(tmp_path, monkeypatch):
    """A sequence found stopped is still in the launches behind, which write its next positions into its blocks
    after the host freed them. A prompt given those blocks (here by a free list that hands out the newest first)
    must wait for the launches: its tokens' log-probabilities then equal transformers'. With the check turned
    off the prompt runs beside, the launches overwrite part of its cache, and the log-probabilities are off:
    the harness shows the hazard the check prevents."""
    from collections import OrderedDict

    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import model as model_mod
    from surge.runtime.scheduler.sequence import SeqStatus

    class NewestFirst(OrderedDict):
        def popitem(self, last=False):
            return super().popitem(last=True)

    torch.set_num_threads(1)
    d = build_model("qwen2", tmp_path / "q", seed=2)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    runner, joiner = (torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 20))
    stopper, answer, stop = _stopper(hf, g, 6)
    full = prompt_and_answer = joiner + _greedy(hf, joiner, 10)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), -1)
    want = [lp[len(joiner) - 1 + i, t].item() for i, t in enumerate(prompt_and_answer[len(joiner):])]

    def run(check: bool):
        engine, attention = _engine(d, num_blocks=64)
        monkeypatch.setattr(model_mod, "paged_attention_torch", attention)
        dev = Behind(engine)
        sched = _scheduler(64)
        sched.blocks.free = NewestFirst(sched.blocks.free)
        if not check:
            monkeypatch.setattr(sched.blocks, "settled", lambda blocks, since: True)
        seqs = [Sequence(0, runner, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
                Sequence(1, stopper, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=(answer[stop],))),
                Sequence(2, joiner, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0))]
        loop = StepLoop(sched, dev, overlap=True, depth=2, steps=3, beside=True)
        sched.add(seqs[0])
        sched.add(seqs[1])
        lps, behind_stopper = [], None
        while loop.busy or behind_stopper is None:
            for r in loop.step():
                if r.samples and 2 in r.samples:
                    lps.append(r.samples[2].logprob)
            if behind_stopper is None and seqs[1].status is SeqStatus.FINISHED:
                behind_stopper = sum(any(s.seq.seq_id == 1 for s in p.scheduled) for p in dev.queue)
                sched.add(seqs[2])  # arrives while the stopper's later launches are in flight
        assert seqs[1].output_ids == answer[:stop + 1] and behind_stopper > 0
        assert seqs[2].output_ids == prompt_and_answer[len(joiner):]
        return lps, loop.beside_steps

    lps, beside = run(check=True)
    assert beside == 0 and len(lps) == 10
    assert max(abs(a - b) for a, b in zip(lps, want)) < 1e-4
    lps, beside = run(check=False)
    assert beside == 1 and max(abs(a - b) for a, b in zip(lps, want)) > 1e-3, "the harness must show the hazard"


def test_the_setting_reaches_the_step_loop(tmp_path):
    """GenerationConfig.prefill_beside (default on) is the engine loop's `beside`."""
    from surge.runtime.generate_core import EngineLoop
    from surge.runtime.generate_service import GenerationConfig

    engine = DecoderEngine(build_model("gpt2", tmp_path / "g", seed=1), num_blocks=16, block_size=4, max_num_seqs=2)
    assert GenerationConfig().prefill_beside
    assert EngineLoop(engine, GenerationConfig(max_num_seqs=2)).loop.beside
    assert not EngineLoop(engine, GenerationConfig(max_num_seqs=2, prefill_beside=False)).loop.beside
    assert engine.beside_stream is None and not engine.can_prefill_beside([])  # no row graphs on the CPU


def test_an_arrival_cuts_the_wait_for_the_device_short(tmp_path, monkeypatch):
    """With `wait` (the engine loop's inbox), a prompt that arrives while the loop waits for its oldest launch is
    prefilled beside at the next iteration, that launch and the ones behind it still unread (three in flight:
    depth + 1), and its first token is returned before any of them is read back; every sequence still gets
    transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import model as model_mod

    torch.set_num_threads(1)
    d = build_model("qwen2", tmp_path / "q", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 12, 15)]
    lens = [24, 20, 9]
    refs = [_greedy(hf, p, n) for p, n in zip(prompts, lens)]
    engine, attention = _engine(d)
    monkeypatch.setattr(model_mod, "paged_attention_torch", attention)
    dev = Behind(engine)
    sched = _scheduler()
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lens))]
    loop = StepLoop(sched, dev, overlap=True, depth=2, steps=3, beside=True)
    arrived, queued = [], []
    # the device "finishes" a launch whenever asked, except once the runners have made 9 steps: then the
    # joiner arrives during the wait
    dev.ready = lambda handle: bool(arrived) or loop.steps < 9

    def wait(timeout):
        assert timeout > 0 and not arrived
        arrived.append(loop.steps)
        sched.add(seqs[2])
        return True

    beside = engine.prefill_beside
    monkeypatch.setattr(engine, "prefill_beside", lambda sc: queued.append(len(dev.queue)) or beside(sc))
    sched.add(seqs[0])
    sched.add(seqs[1])
    streamed = {s.seq_id: [] for s in seqs}
    first_at = None
    while loop.busy:
        for r in loop.step(None, wait):
            for sid, t in r.tokens.items():
                streamed[sid].append(t)
                if sid == 2 and first_at is None:
                    first_at = len(dev.queue)
    assert arrived and queued == [3] and first_at == 3, (arrived, queued, first_at)
    for s, ref in zip(seqs, refs):
        assert s.output_ids == ref == streamed[s.seq_id], f"prompt {s.seq_id}"
    assert sched.blocks.num_free == 96


def test_a_sequence_stopped_in_the_launch_read_back_is_not_launched_again(tmp_path, monkeypatch):
    """A wait for the device cut short by a message that adds no sequence (an abort of another request, say)
    leaves depth + 1 launches in flight; the next iteration reads the oldest back before launching behind it. A
    sequence found stopped there was scheduled on tokens that are now gone: it is left out of that launch (it
    used to be launched from a position past its cut tokens). Every sequence gets transformers' greedy tokens,
    the stopper's cut at its stop, and every block is free at the end."""
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import model as model_mod

    torch.set_num_threads(1)
    d = build_model("qwen2", tmp_path / "q", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    runner = torch.randint(3, 300, (9,), generator=g).tolist()
    stopper, answer, stop = _stopper(hf, g, 4)
    engine, attention = _engine(d)
    monkeypatch.setattr(model_mod, "paged_attention_torch", attention)
    dev = Behind(engine)
    dev.ready = lambda handle: False  # the loop never sees a launch done before it reads it back
    sched = _scheduler()
    seqs = [Sequence(0, runner, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
            Sequence(1, stopper, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=(answer[stop],)))]
    loop = StepLoop(sched, dev, overlap=True, depth=2, steps=3, beside=True)
    flying = []  # launches in flight after each iteration
    for q in seqs:
        sched.add(q)
    while loop.busy:
        loop.step(None, lambda timeout: True)  # a message every time: the wait always ends at once
        flying.append(len(loop._inflight))
        sched.blocks.check()
    assert max(flying) == 3, "depth + 1 launches in flight: the next launch read the oldest back first"
    assert seqs[0].output_ids == _greedy(hf, runner, 24)
    assert seqs[1].output_ids == answer[:stop + 1]
    assert sched.blocks.num_free == 96


def test_prefix_hits_and_sampling_options_beside_the_launches(tmp_path, monkeypatch):
    """Joiners beside the launches: one whose prompt starts with a running sequence's (its prefix blocks, named
    from a synchronous step, are shared and settled: it goes beside with cached tokens), two in a row sharing a new
    prefix (the second takes the blocks the first's step beside named, settled too, and all its prompt but the last
    token, a one-token chunk that looks like a decode and still goes beside), and one asking for
    log-probabilities (sampled on the host: it goes beside, then the loop reads the launches back for its next
    steps). Tokens equal transformers' greedy ones and the log-probabilities its float64 ones."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    d = build_model("llama", tmp_path / "l", seed=5)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(3, 300, (12,), generator=g).tolist()
    burst = torch.randint(3, 300, (8,), generator=g).tolist()  # a new system prompt, two requests in a row
    prompts = [shared + [7, 8], torch.randint(3, 300, (10,), generator=g).tolist(), shared + [9, 10, 11],
               burst + [4, 5], burst + [6], torch.randint(3, 300, (8,), generator=g).tolist()]
    lens = [30, 28, 10, 6, 5, 9]
    refs = [_greedy(hf, p, n) for p, n in zip(prompts, lens)]
    dev, beside = _watched(d, monkeypatch)
    sched = _scheduler()
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                          logprobs=0 if i == 5 else None))
            for i, (p, n) in enumerate(zip(prompts, lens))]
    loop = StepLoop(sched, dev, overlap=True, depth=2, steps=3, beside=True)
    arrivals = [0, 0, 4, 7, 8, 12]
    lps, step, added = [], 0, 0
    while added < len(seqs) or loop.busy:
        while added < len(seqs) and arrivals[added] <= step:
            sched.add(seqs[added])
            added += 1
        for r in loop.step():
            if r.samples and 5 in r.samples:
                lps.append(r.samples[5].logprob)
        sched.blocks.check()
        step += 1
    for s, ref in zip(seqs, refs):
        assert s.output_ids == ref, f"prompt {s.seq_id}"
    assert all(any(sid in b for b in beside) for sid in (2, 3, 4, 5)), beside
    assert seqs[2].num_cached_prompt == 12, "the shared prefix's blocks were taken from the cache"
    # the second of the burst shares the blocks the first's step beside named: their K/V were written by then
    assert seqs[4].num_cached_prompt == 8
    full = prompts[5] + refs[5]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), -1)
    want = [lp[len(prompts[5]) - 1 + i, t].item() for i, t in enumerate(refs[5])]
    assert len(lps) == len(want) and max(abs(a - b) for a, b in zip(lps, want)) < 1e-4


def test_launches_dropped_after_an_engine_error_still_run_before_a_step_beside(tmp_path, monkeypatch):
    """An engine error in a step (here the step beside the launches, e.g. a guided prompt whose grammar fails)
    fails the step's requests (loop.involved()) and drops the launches in flight from the loop's books, but the
    device still runs them (a GPU's queued work), writing the failed sequences' next positions into blocks the
    host has freed. A prompt given those blocks must not run beside the next launch (made after the blocks were
    freed, so their clock says settled) until the dropped launches are known done: its tokens then equal
    transformers'."""
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import model as model_mod
    from surge.runtime.scheduler.sequence import SeqStatus

    class InOrder(Behind):
        def step(self, scheduled):  # a synchronous step runs after the queued launches (stream order)
            if self.queue:
                self._run(self.queue[-1])
            return self.engine.step(scheduled)

    torch.set_num_threads(1)
    d = build_model("qwen2", tmp_path / "q", seed=2)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    a_prompt, b_prompt, p2_prompt = (torch.randint(3, 300, (n,), generator=g).tolist() for n in (8, 7, 12))
    p1_prompt = a_prompt + [5]  # a's prompt blocks cached: a one-token chunk, launched (not prefilled)
    engine, attention = _engine(d)
    monkeypatch.setattr(model_mod, "paged_attention_torch", attention)
    dev = InOrder(engine)
    sched = _scheduler()
    loop = StepLoop(sched, dev, overlap=True, depth=2, steps=3, beside=True)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    a, b = Sequence(0, a_prompt, SamplingParams(max_tokens=30, **greedy)), \
        Sequence(1, b_prompt, SamplingParams(max_tokens=30, **greedy))
    bad = Sequence(2, [7, 8, 9], SamplingParams(max_tokens=4, **greedy))
    p1 = Sequence(3, p1_prompt, SamplingParams(max_tokens=8, **greedy))
    p2 = Sequence(4, p2_prompt, SamplingParams(max_tokens=8, **greedy))
    sched.add(a)
    sched.add(b)
    while len(loop._inflight) < 2:
        loop.step()
    beside = engine.prefill_beside

    def failing(sc):
        if any(s.seq is bad for s in sc):
            raise RuntimeError("the guide could not be built")
        return beside(sc)

    monkeypatch.setattr(engine, "prefill_beside", failing)
    sched.add(bad)
    with pytest.raises(RuntimeError):
        loop.step()
    for q in loop.involved():  # the step's requests fail (contain() drops the launches from the books the same way)
        sched.abort(q, "error")
    assert a.status is b.status is SeqStatus.FINISHED and not loop.busy
    stale = [(s.seq.block_table[p // 4], p % 4) for pend in dev.queue for s in pend.scheduled
             for p in range(s.start, s.start + pend.steps)]
    assert stale, "launches dropped from the loop's books are still queued on the device"
    sched.add(p1)
    loop.step()
    assert p1.num_cached_prompt == 8 and len(loop._inflight) == 1, "p1's one-token chunk was launched"
    for blk in dict.fromkeys(blk for blk, _ in stale):  # a free list that hands out those blocks first
        sched.blocks.free.move_to_end(blk, last=False)
    sched.add(p2)
    while loop.busy:
        loop.step()
    assert p1.output_ids == _greedy(hf, p1_prompt, 8)
    assert p2.output_ids == _greedy(hf, p2_prompt, 8)
    assert sched.blocks.num_free == 96
