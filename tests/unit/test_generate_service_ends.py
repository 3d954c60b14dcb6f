"""How GenerateService's streams end: a stop string at the last allowed token, stop strings and min_tokens, a model
unloaded during a shared-cache lookup or in the pass that submitted a stream, a deadline passed while the consumer is
away. A real service on the tiny Qwen2 model, its engine loop on a thread; each test failed before its fix."""

from __future__ import annotations

import asyncio
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry  # noqa: E402

from surge.errors import DeadlineExceeded, NotReady  # noqa: E402
from surge.runtime.scheduler import SamplingParams  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("m") / "q", seed=3)


def _service(path, registry=None, timeout_s: float = 30.0, **gen):
    from tokenizers import Tokenizer

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService, GenerationConfig

    torch.set_num_threads(1)
    engine = DecoderEngine(path, num_blocks=256, block_size=4, max_num_seqs=8, max_model_len=128)
    config = GenerationConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128,
                              **{"cache_entries": 8, **gen})
    s = GenerateService("m", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")), None, config,
                        request_timeout_s=timeout_s, metrics_registry=registry or CollectorRegistry())
    s.mark_ready()
    return s


def _value(registry, name, **labels):
    v = registry.get_sample_value(name, {"model": "m", "version": "1", **labels})
    return v or 0.0


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_as_stop(model_dir):
    """The engine ends the sequence at max_tokens ("length") with the very token that completes a stop
    string: the text is cut before the stop string, so the answer ended by the stop string; vLLM
    reports finish_reason "stop" with the stop string as stop_reason (its stop-string check overrides
    the engine's length). Here the text was cut but the finish said "length" (and stop_reason None)."""
    reg = CollectorRegistry()
    service = _service(model_dir, reg, cache_entries=0)
    prompt = service.encode("The augmented assignment")

    async def main():
        free = await service.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        texts = [service.decode(free.token_ids[:i]) for i in range(1, 11)]
        # the first token whose text adds a piece not seen before: a stop string it completes
        k = next(i for i in range(1, 10) if texts[i][len(texts[i - 1]):].strip()
                 and texts[i][len(texts[i - 1]):] not in texts[i - 1])
        stop = texts[k][len(texts[k - 1]):]
        at_end = await service.generate(prompt, SamplingParams(max_tokens=k + 1, temperature=0.0, ignore_eos=True,
                                                               stop=(stop,)))
        later = await service.generate(prompt, SamplingParams(max_tokens=k + 3, temperature=0.0, ignore_eos=True,
                                                              stop=(stop,)))
        await service.close()
        return texts[k - 1], stop, at_end, later

    before, stop, at_end, later = asyncio.run(main())
    # the stop string matched before the last token: "stop", cut before it
    assert later.finish_reason == "stop" and later.stop_reason == stop and later.text == before
    # the same text, cut by the same stop string, with the last token allowed
    assert at_end.text == before
    assert (at_end.finish_reason, at_end.stop_reason) == ("stop", stop)
    assert _value(reg, "surge_generate_requests_total", finish_reason="stop") == 2


def test_a_stop_string_written_before_min_tokens_never_ends_the_answer(model_dir):
    """vLLM's min_tokens: no stop string ends the answer before that many tokens, and a stop string
    written in those tokens is not looked for again (only matches with new text are). Here the search
    window reached back into text already shown, so the stop string written before min_tokens ended
    the answer at min_tokens, left in the text (with finish "stop" and it as stop_reason) though
    include_stop_str_in_output is off."""
    service = _service(model_dir, cache_entries=0)
    prompt = service.encode("Hello world")

    async def main():
        free = await service.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        first2 = service.decode(free.token_ids[:2])
        got = await service.generate(prompt, SamplingParams(max_tokens=8, min_tokens=3, temperature=0.0,
                                                            ignore_eos=True, stop=(first2,)))
        await service.close()
        return free, first2, got

    free, stop, got = asyncio.run(main())
    assert free.text.count(stop) == 1  # the stop string is written once, by tokens 1-2 (before min_tokens)
    assert got.token_ids == free.token_ids and got.text == free.text
    assert got.finish_reason == "length" and got.stop_reason is None


class _SlowTier:
    """A shared generation-cache tier (Redis) whose lookup takes a while and finds nothing."""

    def __init__(self):
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def get_bytes(self, key):
        self.asked.set()
        await self.answer.wait()
        return None

    async def put_bytes(self, key, value):
        return None


def test_a_stream_whose_shared_cache_lookup_outlives_the_model_fails_as_not_ready(model_dir):
    """stream() checks that the model is ready, then awaits the shared cache tier (Redis) for a
    deterministic request. A model unloaded meanwhile (or whose engine process died and is being
    started again) had its streams failed already, yet this one went on and submitted its sequence to
    an engine loop that was gone: it hung until its deadline (504) instead of answering 503 at once."""
    service = _service(model_dir, timeout_s=3.0)
    tier = service.shared = _SlowTier()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = service.encode("The augmented assignment")

    async def main():
        task = asyncio.ensure_future(service.generate(prompt, params))
        await tier.asked.wait()
        await service.close()  # unloaded while the lookup runs
        tier.answer.set()
        t0 = time.monotonic()
        try:
            await task
            return None, time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001
            return exc, time.monotonic() - t0

    err, took = asyncio.run(main())
    assert not isinstance(err, DeadlineExceeded), f"hung {took:.1f} s until the deadline"
    assert isinstance(err, NotReady)


def test_a_stream_submitted_in_the_pass_that_closes_the_service_ends_at_once(model_dir, monkeypatch):
    """A stream's sequence reaches the engine thread at the end of the event-loop pass that submitted it
    (GenerateService._arrive). close() in that same pass puts "close" first; an engine thread that takes
    it before the "add" (the event loop held up a moment after close() put it, the GIL free) exits, and
    the stream, whose sequence nobody will ever run, waited for its deadline (504): unlike the engine
    process's close(), the thread's close() failed no stream it left behind."""
    service = _service(model_dir, timeout_s=3.0, cache_entries=0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = service.encode("The augmented assignment")
    channel = service._channel
    put = channel.put

    def slow_put(msg):
        put(msg)
        if msg[0] == "close":
            time.sleep(0.2)  # the event loop busy a moment (parsing other requests, say)

    monkeypatch.setattr(channel, "put", slow_put)

    async def main():
        await service.generate(prompt, params, use_cache=False)  # the engine thread runs and is idle
        # in one pass: the stream runs up to its wait (its "add" due at the pass's end), then close() starts
        task = asyncio.ensure_future(service.generate(prompt, params, use_cache=False))
        closing = asyncio.ensure_future(service.close())
        t0 = time.monotonic()
        try:
            await task
            err = None
        except Exception as exc:  # noqa: BLE001
            err = exc
        await closing
        return err, time.monotonic() - t0

    err, took = asyncio.run(main())
    assert not isinstance(err, DeadlineExceeded), f"hung {took:.1f} s until the deadline"
    assert isinstance(err, NotReady)


def test_a_deadline_passed_while_the_consumer_is_away_stops_the_sequence_at_once(model_dir):
    """The request deadline fails the stream, but only its consumer's next wait aborted the sequence: a
    consumer held up elsewhere (a client that stops reading, its writes blocked) left the sequence
    running in the engine past the deadline, to max_tokens, its KV blocks and batch slot taken, every
    token computed for nobody (the stream drops them)."""
    service = _service(model_dir, timeout_s=0.3, cache_entries=0)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompt = service.encode("The augmented assignment")
    engine_step = service.engine.step

    def step(*args, **kwargs):  # a step of a real model's time: 120 tokens take well over the deadline
        time.sleep(0.01)
        return engine_step(*args, **kwargs)

    service.engine.step = step

    async def main():
        agen = service.stream(prompt, params)
        first = await agen.__anext__()
        (handle,) = service._handles.values()
        seq = handle.seq
        # the consumer is away (its client's socket full, say) until the engine has ended the sequence: by the
        # deadline (0.3 s) or, before the fix, at max_tokens (120 steps of >= 10 ms)
        while seq.finish_reason is None:
            await asyncio.sleep(0.05)
        at = (seq.finish_reason, len(seq.output_ids))
        try:
            async for _ in agen:
                pass
            err = None
        except Exception as exc:  # noqa: BLE001
            err = exc
        await service.close()
        return first, at, err

    first, (reason, made), err = asyncio.run(main())
    assert isinstance(err, DeadlineExceeded)
    assert reason == "abort" and made < 120, (reason, made)


def test_an_end_token_named_in_stop_token_ids_is_the_stop_reason(model_dir):
    """vLLM reports a stop token id the request named as stop_reason even where it is also the model's EOS
    (stop_token_ids=[eos] with ignore_eos is how clients stop at EOS only after min_tokens, say); a plain EOS
    stop has none."""
    service = _service(model_dir, cache_entries=0)
    eos = service.engine.cfg.eos_token_ids[0]
    prompt = service.encode("The augmented assignment")

    async def main():
        named = await service.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                              stop_token_ids=(eos,), logit_bias=((eos, 100.0),)))
        plain = await service.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0,
                                                              logit_bias=((eos, 100.0),)))
        return named, plain

    try:
        named, plain = asyncio.run(main())
    finally:
        asyncio.run(service.close())
    assert named.finish_reason == plain.finish_reason == "stop"
    assert named.stop_reason == eos
    assert plain.stop_reason is None
