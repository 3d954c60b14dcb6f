"""GenerateService's streams on the CPU engine: one pass per engine step builds every stream's delta
(text, stop strings, metrics); what a client sees and what is counted does not depend on how it
consumes the stream."""

from __future__ import annotations

import asyncio
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry  # noqa: E402

from surge.runtime.scheduler import SamplingParams  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("m") / "q", seed=3)


def _service(path, registry, **gen):
    from tokenizers import Tokenizer

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService, GenerationConfig

    torch.set_num_threads(1)
    engine = DecoderEngine(path, num_blocks=256, block_size=4, max_num_seqs=8, max_model_len=128)
    config = GenerationConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128,
                              **{"cache_entries": 8, **gen})
    s = GenerateService("m", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")), None, config,
                        request_timeout_s=30, metrics_registry=registry)
    s.mark_ready()
    return s


def _value(registry, name, **labels):
    v = registry.get_sample_value(name, {"model": "m", "version": "1", **labels})
    return v or 0.0


def test_a_client_that_stops_at_the_finish_reason_is_counted_and_cached(model_dir):
    """The HTTP routes close the stream as soon as they have the delta with the finish reason:
    the request is counted under its reason (not as an abort), its metrics are complete, and a
    deterministic one is cached."""
    reg = CollectorRegistry()
    service = _service(model_dir, reg)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = service.encode("The augmented assignment")

    async def until_finish():
        agen = service.stream(prompt, params)
        deltas = []
        async for d in agen:
            deltas.append(d)
            if d.finish_reason is not None:
                break
        await agen.aclose()
        return deltas

    async def main():
        first = await until_finish()
        await asyncio.sleep(0.05)  # an abort, if one were sent, would be counted by now
        second = await until_finish()
        whole = await service.generate(prompt, params, use_cache=False)
        await service.close()
        return first, second, whole

    first, second, whole = asyncio.run(main())
    ids = [t for d in first for t in d.token_ids]
    assert len(ids) == 12 and first[-1].finish_reason == "length" and first[-1].completion_tokens == 12
    assert "".join(d.text for d in first) == service.decode(ids) == whole.text and whole.token_ids == ids
    assert all(d.cached for d in second) and [d.text for d in second] == [d.text for d in first]
    # three requests, the second answered from the cache under its cached reason; the engine generated 24 tokens
    assert _value(reg, "surge_generate_requests_total", finish_reason="length") == 3
    assert _value(reg, "surge_generate_requests_total", finish_reason="abort") == 0
    assert _value(reg, "surge_generate_output_tokens_total") == 24
    assert _value(reg, "surge_generate_inter_token_latency_seconds_count") == 22
    assert _value(reg, "surge_generate_time_to_first_token_seconds_count") == 2


def test_streams_consumed_at_different_paces_get_the_same_text(model_dir):
    """A stream whose consumer lags gets the tokens delivered meanwhile merged into one delta; the
    concatenation is the same text and tokens; a stop string ends a stream exactly before it and
    frees its blocks."""
    reg = CollectorRegistry()
    service = _service(model_dir, reg, cache_entries=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [service.encode(t) for t in ("The augmented assignment", "Names are", "Then it stops")]

    async def consume(p, lag, stop=()):
        deltas = []
        prm = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop)
        async for d in service.stream(p, prm):
            deltas.append(d)
            for _ in range(lag):
                await asyncio.sleep(0.002)
        return deltas

    async def main():
        ref = [await service.generate(p, params) for p in prompts]
        runs = await asyncio.gather(*(consume(p, lag) for p in prompts for lag in (0, 3)))
        cut = ref[0].text[3:7]
        stopped = await consume(prompts[0], 0, (cut,))
        await asyncio.sleep(0.05)
        free = service.scheduler.blocks.num_free
        await service.close()
        return ref, runs, stopped, free

    ref, runs, stopped, free = asyncio.run(main())
    for i, deltas in enumerate(runs):
        want = ref[i // 2]
        assert "".join(d.text for d in deltas) == want.text
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 24
        assert [d.completion_tokens for d in deltas] == sorted({d.completion_tokens for d in deltas})
    assert any(len(d.token_ids) > 1 for i in (1, 3, 5) for d in runs[i]), "a lagging consumer gets merged deltas"
    text = "".join(d.text for d in stopped)
    assert stopped[-1].finish_reason == "stop" and text == ref[0].text[:ref[0].text.index(ref[0].text[3:7])]
    assert free == 256


def test_a_stream_whose_text_fails_fails_alone(model_dir, monkeypatch):
    """The event loop builds all streams' deltas in one pass: an exception in one stream's text (a
    tokenizer that raises, say) reaches that stream's consumer, frees its blocks and is counted as
    an abort; the streams beside it go on unchanged."""
    import surge.runtime.generate_service as gs

    reg = CollectorRegistry()
    service = _service(model_dir, reg, cache_entries=0)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [service.encode(t) for t in ("The augmented assignment", "Names are", "Then it stops")]
    made, plain = [], gs.TextState

    class Failing(plain):
        def add(self, token, final=False):
            if len(self.ids) == 4:
                raise RuntimeError("tokenizer broke")
            return super().add(token, final)

    def text_state(*args):
        made.append(None)
        return (Failing if len(made) == 2 else plain)(*args)

    async def main():
        ref = [await service.generate(p, params) for p in prompts]
        made.clear()
        monkeypatch.setattr(gs, "TextState", text_state)
        got = await asyncio.gather(*(service.generate(p, params) for p in prompts), return_exceptions=True)
        await asyncio.sleep(0.05)
        free = service.scheduler.blocks.num_free
        await service.close()
        return ref, got, free

    ref, got, free = asyncio.run(main())
    assert isinstance(got[1], RuntimeError) and "tokenizer broke" in str(got[1])
    for i in (0, 2):
        assert got[i].text == ref[i].text and got[i].token_ids == ref[i].token_ids
    assert free == 256
    assert _value(reg, "surge_generate_requests_total", finish_reason="abort") == 1
    assert _value(reg, "surge_generate_requests_total", finish_reason="length") == 5


def _record_schedules(service):
    """What each scheduler call admitted: the number of sequences scheduled for the first time (a
    prefix-cache hit starts past 0, so the start position does not tell)."""
    seen, known = [], set()
    schedule = service.scheduler.schedule

    def wrapped():
        out = schedule()
        new = {s.seq.seq_id for s in out} - known
        known.update(new)
        seen.append(len(new))
        return out

    service.scheduler.schedule = wrapped
    return seen


def test_requests_submitted_in_one_event_loop_pass_are_prefilled_in_one_step(model_dir):
    """A burst (here a gather of 8 streams, as HTTP requests read in one pass) reaches the engine
    thread at the pass's end, so an idle engine prefills it in one step instead of starting with the
    first few; each stream's tokens equal the same prompt generated alone."""
    reg = CollectorRegistry()
    service = _service(model_dir, reg, cache_entries=0)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 30, (8,), generator=g)]

    async def submit(p):
        # a pass that takes a while (parsing many requests, say), with the GIL free meanwhile: time in
        # which the engine thread, woken by the first submission, could start without the others
        time.sleep(0.003)
        return await service.generate(p, params)

    async def main():
        alone = [(await service.generate(p, params)).token_ids for p in prompts[:2]]
        rounds = []
        for _ in range(3):
            seen = _record_schedules(service)
            outs = await asyncio.gather(*(submit(p) for p in prompts))
            del service.scheduler.schedule
            rounds.append(([o.token_ids for o in outs], [n for n in seen if n]))
        await service.close()
        return alone, rounds

    alone, rounds = asyncio.run(main())
    for tokens, admitted in rounds:
        assert admitted == [8], admitted  # all eight prompts started in one step
        assert tokens[:2] == alone and all(len(t) == 6 for t in tokens)


def test_a_stream_closed_before_its_pass_ends_never_reaches_the_engine(model_dir):
    """Closed in the same event-loop pass that submitted it: no step computes it, and its
    neighbours' tokens are those they get alone."""
    reg = CollectorRegistry()
    service = _service(model_dir, reg, cache_entries=0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    keep, drop = service.encode("The augmented assignment"), service.encode("An unrelated prompt here")

    async def main():
        alone = (await service.generate(keep, params)).token_ids
        seen = _record_schedules(service)
        gone = service.stream(drop, params)
        step = gone.__anext__()
        # driven by hand inside this task's own step, so submitting and closing fall in one pass:
        # the generator runs up to its wait for a token (the prompt submitted) ...
        step.send(None)
        time.sleep(0.003)  # the GIL free: time for an engine thread that had the prompt to take it
        with pytest.raises(asyncio.CancelledError):  # ... and is cancelled there, as a client that left
            step.throw(asyncio.CancelledError())
        kept = asyncio.ensure_future(service.generate(keep, params))
        out = await kept
        await service.close()
        return alone, out.token_ids, seen

    alone, tokens, seen = asyncio.run(main())
    assert tokens == alone
    assert [n for n in seen if n] == [1]  # only the kept prompt was ever admitted
    assert _value(reg, "surge_generate_requests_total", finish_reason="abort") == 1
