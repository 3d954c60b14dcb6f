"""A failed generation step contained per sequence (StepLoop.contain), on a real model on the CPU: the sequence at
fault fails, its neighbours in the step run again alone (recomputed from the tokens they had) and get the answers
they get without the failure (transformers' greedy tokens; a seeded draw's and a guide's own tokens), their streams
complete, every KV block comes back. The fault is injected where the engine has one: a read-back or a step holding
the bad sequence raises (an asynchronous device error surfaces there), or the bad request's guide matcher raises."""

from __future__ import annotations

import asyncio
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry  # noqa: E402

from surge.runtime.scheduler import SamplingParams, Sequence  # noqa: E402
from surge.runtime.scheduler.overlap import StepLoop  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402
from tests.unit.test_prefill_beside import Behind, _engine, _greedy, _scheduler  # noqa: E402

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("m") / "q", seed=2)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class FaultyDevice(Behind):
    """The harness's "device" (launches run when read back, in order; a synchronous step after the launches
    queued, as on one CUDA stream), with a fault tied to sequence `bad`: reading back a launch that holds it, or a
    synchronous step of it, raises (its launch stays queued and still runs, as a GPU's queued work does)."""

    def __init__(self, engine, bad: int):
        super().__init__(engine)
        self.bad, self.raised = bad, 0

    def _fault(self, seqs) -> None:
        if any(q.seq_id == self.bad for q in seqs):
            self.raised += 1
            raise RuntimeError("an illegal memory access was encountered")

    def collect_tokens(self, handle):
        self._fault(s.seq for s in handle.scheduled)
        return super().collect_tokens(handle)

    def step(self, scheduled):
        if self.queue:
            self._run(self.queue[-1])
        self._fault(s.seq for s in scheduled)
        return self.engine.step(scheduled)


@pytest.mark.parametrize("depth,steps,beside", [(1, 1, False), (2, 1, True), (1, 3, False), (2, 3, True)])
def test_a_launch_that_raises_for_one_sequence_fails_only_it(model_dir, hf, monkeypatch, depth, steps, beside):
    """Greedy sequences decoding in overlapped (and multi-step) launches, one of them bad: the read-back of every
    launch that holds it raises. The launches in flight are dropped (still run on the "device", writing into
    blocks the host freed); the bad sequence fails after its one step alone; the others, recomputed from the
    tokens they had handed out, get transformers' greedy tokens, each handed out once, in order; a prompt arriving
    later too; every block comes back."""
    from surge.engines.decoder import model as model_mod

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 6, 13, 7, 10)]
    lens = [24, 18, 21, 20, 12]
    refs = [_greedy(hf, p, n) for p, n in zip(prompts, lens)]
    engine, attention = _engine(model_dir, steps=max(steps, 2))
    monkeypatch.setattr(model_mod, "paged_attention_torch", attention)
    bad = 2
    dev = FaultyDevice(engine, bad)
    sched = _scheduler()
    loop = StepLoop(sched, dev, overlap=True, depth=depth, steps=steps, beside=beside)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, **GREEDY)) for i, (p, n) in enumerate(zip(prompts, lens))]
    arrivals = [0, 0, 0, 0, 6]
    streamed, failed = {q.seq_id: [] for q in seqs}, []
    for it in range(300):
        for q, at in zip(seqs, arrivals):
            if at == it:
                sched.add(q)
        if not loop.busy and it > max(arrivals):
            break
        try:
            results = loop.step()
        except RuntimeError:
            results, gone = loop.contain()
            for q in gone:
                sched.abort(q, "error")
                failed.append(q.seq_id)
        for r in results:
            for sid, t in r.tokens.items():
                streamed[sid].append(t)
        sched.blocks.check()
    assert not loop.busy, "the loop never went idle"
    assert failed == [bad] and dev.raised == 2, "the bad sequence fails after its step alone"
    assert sched.retries >= 2, "its neighbours ran again"
    for q, ref in zip(seqs, refs):
        if q.seq_id == bad:
            continue
        assert q.output_ids == ref, f"sequence {q.seq_id}"
        assert streamed[q.seq_id] == ref, f"sequence {q.seq_id}: tokens repeated or lost"
    assert sched.blocks.num_free == 96


@pytest.mark.parametrize("depth,steps,beside", [(0, 1, False), (1, 1, False), (2, 1, True), (2, 3, True)])
def test_the_batch_keeps_decoding_while_a_bad_sequence_is_quarantined(model_dir, hf, monkeypatch, depth, steps, beside):
    """A bad sequence (every launch or step that holds it raises) arrives while four greedy sequences decode: the
    failed step's sequences go to the quarantine, the bad one last. While it drains, a step alone at a time, the
    sequences that rejoined the batch advance every iteration (a token, or a launched step read back at the next)
    and a prompt arriving then is admitted (both used to wait for the whole quarantine); the bad one still fails alone, after its step alone, and every
    other sequence gets transformers' greedy tokens, each handed out once, in order; every block comes back."""
    from surge.engines.decoder import model as model_mod
    from tests.unit import test_step_loop_failures as failures

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 6, 13, 7, 10, 8)]
    lens = [24, 18, 21, 20, 12, 14]
    refs = [_greedy(hf, p, n) for p, n in zip(prompts, lens)]
    engine, attention = _engine(model_dir, steps=max(steps, 2))
    monkeypatch.setattr(model_mod, "paged_attention_torch", attention)
    bad, arrivals = 4, [0, 0, 0, 0, 3, None]
    dev = FaultyDevice(engine, bad)
    sched = _scheduler()
    loop = StepLoop(sched, dev, overlap=depth > 0, depth=max(depth, 1), steps=steps, beside=beside)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=n, **GREEDY)) for i, (p, n) in enumerate(zip(prompts, lens))]
    streamed, failed, watched = failures._serve_watching(loop, sched, seqs, arrivals)
    assert failed == {bad} and dev.raised == 2, "the bad sequence fails after its step alone"
    failures.check_quarantine_beside_the_batch(watched, seqs, arrivals)
    for q, ref in zip(seqs, refs):
        if q.seq_id != bad:
            assert q.output_ids == ref, f"sequence {q.seq_id}"
            assert streamed[q.seq_id] == ref, f"sequence {q.seq_id}: tokens repeated or lost"
    assert sched.blocks.num_free == 96 and not sched.quarantine


class _Out:
    """EngineLoop's outbox: the tokens handed out by sequence, the errors, the last state."""

    def __init__(self, ids):
        self.tokens_of = {i: [] for i in ids}
        self.ended, self.errors, self.last = set(), {}, None
        self.done = threading.Event()

    def _check(self):
        if self.ended | set(self.errors) >= set(self.tokens_of):
            self.done.set()

    def tokens(self, batch, admitted, state):
        for toks, _, finished in batch:
            for sid, t in toks.items():
                self.tokens_of[sid].append(t)
            self.ended.update(finished or ())
        self.last = state
        self._check()

    def error(self, seq_id, kind, message):
        self.errors[seq_id] = (kind, message)
        self._check()

    def state(self, state):
        self.last = state


def _mixed(bad_guide: bool):
    """A greedy, two seeded, a guided request, and (`bad_guide`) a guided request whose matcher will raise."""
    choice = ("choice", '["assignment", "Python", "loops repeat"]')
    seqs = [Sequence(0, [5, 6, 7, 8, 9], SamplingParams(max_tokens=14, **GREEDY)),
            Sequence(1, [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)),
            Sequence(2, [9, 8, 7], SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)),
            Sequence(3, [12, 13, 14], SamplingParams(max_tokens=12, temperature=0.0, guide=choice))]
    if bad_guide:
        seqs.append(Sequence(4, [21, 22, 23, 24], SamplingParams(max_tokens=12, temperature=0.0, guide=choice)))
    return seqs


def _serve(model_dir, seqs, bad=None, fail_at=0):
    """The requests through a real EngineLoop on a thread (the service's engine loop); the request `bad` has a
    guide whose matcher raises at its `fail_at`-th token and on. -> (outbox, engine loop)."""
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_core import EngineLoop, ThreadChannel
    from surge.runtime.generate_service import GenerationConfig

    torch.set_num_threads(1)
    engine = DecoderEngine(model_dir, num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=64)
    core = EngineLoop(engine, GenerationConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64))
    if bad is not None:
        matcher = engine.sampler._matcher

        def faulty(seq):  # the bad request's matcher raises where it takes its `fail_at`-th token
            m = matcher(seq)
            if seq.seq_id == bad and not getattr(m, "faulty", False):
                take, m.faulty = m.consume, True

                def consume(token):
                    if m.consumed >= fail_at:
                        raise RuntimeError("the grammar's matcher failed")
                    return take(token)

                m.consume = consume
            return m

        engine.sampler._matcher = faulty
    out, channel = _Out([q.seq_id for q in seqs]), ThreadChannel()
    runner = threading.Thread(target=core.run, args=(channel, out))
    channel.put(("add", seqs))
    runner.start()
    assert out.done.wait(120), "every request ends"
    channel.put(("close",))
    runner.join(30)
    return out, core


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_guide_that_raises_fails_its_request_alone(model_dir, hf, fail_at):
    """A request whose guide matcher raises (at its first token, or its fourth) in a step it shares with a greedy,
    two seeded and a guided request: only it fails (the engine's error); the step's seeded draws and the other
    guide's matcher step, made before the matcher raised, are undone, so every neighbour gets the tokens it gets
    without the bad request (greedy: transformers'), handed out once each; the bad request's sampler state is
    forgotten, every block is back, and the retries are counted in the engine's state."""
    from surge.runtime.generate_core import ENGINE

    ref, _ = _serve(model_dir, _mixed(False))
    assert not ref.errors
    assert ref.tokens_of[0] == _greedy(hf, [5, 6, 7, 8, 9], 14)
    out, core = _serve(model_dir, _mixed(True), bad=4, fail_at=fail_at)
    assert set(out.errors) == {4} and out.errors[4][0] == ENGINE
    assert "RuntimeError" in out.errors[4][1] and "matcher" not in out.errors[4][1]
    for sid in range(4):
        assert out.tokens_of[sid] == ref.tokens_of[sid], f"request {sid}"
    assert len(out.tokens_of[4]) == fail_at, "the bad request's tokens before the fault were handed out"
    assert core.engine.sampler._generators.keys() <= {1, 2} and 4 not in core.engine.sampler._matchers
    assert core.scheduler.blocks.num_free == 64 and core.seqs == {}
    assert out.last.step_retries >= 4


def test_a_streaming_neighbour_of_a_failing_request_completes(model_dir):
    """Through GenerateService: a stream beside a request whose step raises (a hook on the engine's step that
    raises whenever that request is in it) gets its whole answer, the text of the same request without the bad
    neighbour; the bad request gets the engine's error; the retries are counted in the metrics."""
    from tokenizers import Tokenizer

    from surge.engines.decoder import DecoderEngine
    from surge.errors import EngineError
    from surge.runtime.generate_service import GenerateService, GenerationConfig

    def service(registry):
        torch.set_num_threads(1)
        engine = DecoderEngine(model_dir, num_blocks=256, block_size=4, max_num_seqs=8, max_model_len=128)
        config = GenerationConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128, cache_entries=0)
        s = GenerateService("m", "1", model_dir, engine, Tokenizer.from_file(str(model_dir / "tokenizer.json")),
                            None, config, request_timeout_s=60, metrics_registry=registry)
        s.mark_ready()
        return s

    params = SamplingParams(max_tokens=60, temperature=0.8, seed=5, ignore_eos=True)

    async def alone():
        s = service(CollectorRegistry())
        text = "".join([d.text async for d in s.stream(s.encode("The augmented assignment"), params)])
        await s.close()
        return text

    reg = CollectorRegistry()

    async def beside_a_bad_one():
        s = service(reg)
        step = s.engine.step
        bad_prompt = s.encode("A bad request")

        def faulty(scheduled):  # raises whenever the bad request is in the step
            if any(q.seq.prompt_ids == bad_prompt for q in scheduled):
                raise RuntimeError("a bad row")
            return step(scheduled)

        s.engine.step = faulty

        async def bad():
            try:
                await s.generate(bad_prompt, SamplingParams(max_tokens=8, **GREEDY))
            except EngineError as exc:
                return exc
            return None

        parts, task = [], None
        async for d in s.stream(s.encode("The augmented assignment"), params):
            parts.append(d.text)
            if task is None and len(parts) == 3:  # the stream is decoding when the bad request joins its steps
                task = asyncio.ensure_future(bad())
        err = await task
        await s.close()
        return "".join(parts), err

    expected = asyncio.run(alone())
    text, err = asyncio.run(beside_a_bad_one())
    assert isinstance(err, EngineError)
    assert text == expected and len(expected) > 0
    assert reg.get_sample_value("surge_generate_step_retries_total", {"model": "m", "version": "1"}) >= 2
