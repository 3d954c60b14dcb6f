"""What the generation routes share: model lookup by task, sampling params from a request,
server-sent events, and answers that stop when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import orjson
from fastapi.responses import StreamingResponse

from surge.errors import InvalidInput, SurgeError, WrongTask
from surge.runtime.outcome import count_failures, when_delivered
from surge.runtime.scheduler import SamplingParams


def generate_model(state, name: str | None, version: str | None = None):
    service = state.registry.get(name, version)
    task = getattr(service, "task", "embed")
    if task != "generate":
        raise WrongTask(f"model '{service.name}' serves task '{task}', not 'generate'", param="model")
    return service


def stop_list(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# The sampling fields make_params takes by the request's names (KServe generate's parameters, Triton's
# sampling_parameters); the OpenAI routes pass their own attributes.
SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                   "logit_bias", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                   "bad_words", "priority")


def make_params(service, *, max_tokens, temperature, top_p, top_k=None, min_p=None, seed=None, stop=None, min_tokens=None,
                stop_token_ids=None, presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
                ignore_eos=None, logprobs=None, logit_bias=None, prompt_logprobs=None, guide=None,
                allowed_token_ids=None, include_stop_str_in_output=None, skip_special_tokens=None,
                bad_words=None, priority=None) -> SamplingParams:
    model = getattr(service, "sampling_defaults", None) or {}  # the model's generation_config.json (unset fields)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else service.config.default_max_tokens,
        min_tokens=min_tokens or 0,
        temperature=model.get("temperature", 1.0) if temperature is None else float(temperature),
        top_p=model.get("top_p", 1.0) if top_p is None else float(top_p),
        top_k=model.get("top_k", 0) if top_k is None else top_k,
        min_p=model.get("min_p", 0.0) if min_p is None else min_p, seed=seed,
        stop=stop_list(stop), stop_token_ids=token_ids(stop_token_ids, service.vocab_size, "stop_token_ids"),
        presence_penalty=presence_penalty or 0.0, frequency_penalty=frequency_penalty or 0.0,
        repetition_penalty=model.get("repetition_penalty", 1.0) if repetition_penalty is None else repetition_penalty,
        ignore_eos=bool(ignore_eos), logprobs=logprobs,
        logit_bias=bias_list(logit_bias, service.vocab_size), prompt_logprobs=prompt_logprobs,
        own_max_tokens=max_tokens is not None, guide=guide,
        allowed_token_ids=token_ids(allowed_token_ids, service.vocab_size, "allowed_token_ids"),
        include_stop_str_in_output=bool(include_stop_str_in_output),
        skip_special_tokens=skip_special_tokens is not False, bad_words_ids=bad_words_ids(service, bad_words),
        priority=request_priority(service, priority))


def request_priority(service, priority) -> int:
    """vLLM's request `priority` (lower first): only where the model schedules by it."""
    if not priority:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInput("priority must be an integer", param="priority")
    if service.config.scheduling_policy != "priority":
        raise InvalidInput(f"priority {priority} given, but model '{service.name}' schedules first come, first "
                           "served (its generation setting scheduling_policy is 'fcfs')", param="priority")
    return priority


def bad_words_ids(service, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as the token sequences that write them, with and without a leading space (a word
    inside a sentence is usually written with its space)."""
    if not words:
        return ()
    if isinstance(words, str) or not all(isinstance(w, str) and w for w in words):
        raise InvalidInput("bad_words must be a list of non-empty strings", param="bad_words")
    variants = [v for w in words for v in (w, " " + w.lstrip())]
    many = getattr(service, "encode_many", None)  # in batches that let the GIL go (runtime/generate_text.py)
    found = many(variants, special=False) if many is not None else [service.encode(v, special=False)
                                                                    for v in variants]
    out = {tuple(ids) for ids in found}
    return tuple(sorted(ids for ids in out if ids))


def token_ids(ids, vocab_size: int, param: str) -> tuple[int, ...]:
    """A request's list of token ids, checked against the vocabulary."""
    if not ids:
        return ()
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise InvalidInput(f"{param} must be token ids in [0, {vocab_size})", param=param)
    return tuple(sorted(set(ids)))


def bias_list(bias: dict | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as sorted (id, bias) pairs; ids checked against the vocabulary."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidInput(f"logit_bias keys are token ids; got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidInput(f"logit_bias token {token} is not in [0, {vocab_size})", param="logit_bias")
        out.append((token, float(value)))
    return tuple(sorted(out))


def prep_size(req=None, guided: bool | None = None) -> int | None:
    """What decides where a request is prepared (runtime/off_loop.prepared): its body's size (set by
    common.decode_json for this task), or None (on a thread) for a request with a structured output, whose
    guide's first compile costs milliseconds to seconds whatever the body's size. `guided`: whether it
    has one (default: OpenAI's fields and forced tool choices on `req`, guided_fields.asks_guide)."""
    from surge.server.http import fail_fast
    from surge.server.http.guided_fields import asks_guide

    if guided is None:
        guided = req is not None and asks_guide(req)
    return None if guided else fail_fast.BODY_SIZE.get()


def deadline_for(state) -> float:
    return time.monotonic() + state.config.limits.request_timeout_s


async def until_disconnect(receive, work):
    """Await `work`, cancelled at once if the client disconnects (its KV blocks are then freed);
    `receive` is the request's ASGI receive (`request.receive`)."""
    task = asyncio.ensure_future(work)

    async def gone():
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise asyncio.CancelledError("client disconnected")
    finally:
        watcher.cancel()
        if not task.done():  # this request was cancelled (the hot path noticed the client leave first)
            task.cancel()
        # The task holds its exception, whose traceback holds this frame, which held the task: a cycle that
        # kept a failed request (a 2 MB conversation: 90,000 objects) alive until a full collection walked it.
        task = done = None


def _recorded(service) -> bool:
    """Whether a generation that ends now goes into the KServe statistics: not one of a LoRA adapter unloaded
    while it ran (the unload dropped the adapter's statistics; recording it would bring back, for good, an
    entry under a name a client chose)."""
    adapter = getattr(service, "adapter", None)
    return adapter is None or service.base.adapters.get(service.name) is adapter


def _cache_enabled(service) -> bool:
    return bool(getattr(getattr(service, "config", None), "cache_entries", 0))


def _outcome(service):
    """The model's request / failure / latency series (runtime/metrics.RequestCounts), or None (a remote
    model's live in its own process)."""
    return getattr(getattr(service, "metrics", None), "outcome", None)


def _answered(state, service, out, elapsed: int, res) -> None:
    """A generation that ended well (`res`: its result or last delta, `elapsed` ns after it began): counted
    answered (latency, KServe statistics) once the HTTP response carrying it is delivered, or a failure
    under the code of its loss (server/http/delivery.py); on the gRPC port once its call has written it, or
    "cancelled" where it was cut first (runtime/outcome.when_delivered); at once where no answer is watched."""

    def settle(code: str | None) -> None:
        if code is not None:  # its client never got it: as one that left while it was computed
            if out is not None:
                out.failure(code)
            return
        if out is not None:
            out.latency.observe(elapsed / 1e9)
        if _recorded(service):
            state.stats.record_generation(service.name, service.version, elapsed,
                                          getattr(res, "timings", None), bool(getattr(res, "cached", False)),
                                          _cache_enabled(service))

    if not when_delivered(settle):
        settle(None)


async def counted(state, service, work):
    """Await a generation (`service.generate(...)`), counted in the KServe statistics and on /metrics
    (one request; a failure under its code, a client that left as "cancelled", an answer whose response
    was not delivered as "cancelled" too: _answered)."""
    start = time.perf_counter_ns()
    out = _outcome(service)
    if out is not None:
        out.requests.inc()
    try:
        with count_failures(out) if out is not None else contextlib.nullcontext():
            res = await work
    except asyncio.CancelledError:  # the client left: neither a success nor the model's failure
        raise
    except Exception:
        if _recorded(service):
            state.stats.record_failure(service.name, service.version, time.perf_counter_ns() - start)
        raise
    _answered(state, service, out, time.perf_counter_ns() - start, res)
    return res


async def counted_stream(state, service, agen) -> AsyncIterator:
    """A generation stream (`service.stream(...)`), counted in the KServe statistics when its last
    delta passes (once the response carrying it is delivered: _answered) or it fails; a stream the client
    leaves is not counted there. On /metrics it is one request, its latency observed at the last delta; a
    failure counts under its code, a stream closed before its last delta, or whose response was lost before
    its last byte was sent, as "cancelled"."""
    start = time.perf_counter_ns()
    out = _outcome(service)
    if out is not None:
        out.requests.inc()
    finished = False
    try:
        async for d in agen:
            if d.finish_reason is not None:
                finished = True
                _answered(state, service, out, time.perf_counter_ns() - start, d)
            yield d
    except (asyncio.CancelledError, GeneratorExit):
        if out is not None and not finished:
            out.failure("cancelled")
        raise
    except Exception as exc:
        if out is not None and not finished:
            out.failure(exc.code if isinstance(exc, SurgeError) else "internal_error")
        if _recorded(service):
            state.stats.record_failure(service.name, service.version, time.perf_counter_ns() - start)
        raise
    finally:
        await agen.aclose()


def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
               (b"content-type", b"text/event-stream; charset=utf-8")]


@dataclass
class EventStream:
    """A streamed answer: its events after the first (computed before answering, so that 429 / 400 /
    504 keep their status); an error after the headers becomes the event `render_error(exc)`, and
    `done` ends the stream with `data: [DONE]`. `close()`, awaited whatever ends the events (client
    gone, error, end), closes the service's streams at once (here rather than in one more generator
    around `rest`, a layer every chunk would pass)."""

    rest: AsyncIterator[bytes]
    render_error: Callable
    done: bool = True
    close: Callable | None = None

    async def events(self) -> AsyncIterator[bytes]:
        try:
            try:
                async for chunk in self.rest:
                    yield chunk
            except SurgeError as exc:  # after the headers: an error event ends the stream
                yield sse(self.render_error(exc))
            if self.done:
                yield b"data: [DONE]\n\n"
        finally:
            aclose = getattr(self.rest, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.close is not None:
                await self.close()


async def item_stream(state, service, ids, params, deadline, events, after=None) -> EventStream:
    """A streamed answer of the item-based APIs (the Responses API, Anthropic's Messages): `events` renders
    it as the API's events (`start()`, `delta(d)`, `finish(d)`, `failed(exc)`, each a list of bytes); an
    error before any output keeps its HTTP status, one after it is the API's error event; `after` (a
    coroutine function) runs once the answer is whole or has failed after its start (the Responses API
    stores a failed response too). No `[DONE]`."""
    agen = counted_stream(state, service, service.stream(ids, params, deadline=deadline))
    first = await agen.__anext__()

    async def rest():
        for chunk in events.start():
            yield chunk
        d = first
        try:
            while True:
                for chunk in events.delta(d):
                    yield chunk
                if d.finish_reason is not None:
                    break
                d = await agen.__anext__()
        except SurgeError as exc:
            for chunk in events.failed(exc):
                yield chunk
            if after is not None:
                await after()
            return
        for chunk in events.finish(d):
            yield chunk
        if after is not None:
            await after()

    return EventStream(rest(), lambda exc: {}, done=False, close=agen.aclose)


@dataclass
class JsonAnswer:
    body: dict
    headers: dict


def respond(answer: "JsonAnswer | EventStream"):
    """A route's response for an answer (the hot path sends the same itself)."""
    if isinstance(answer, EventStream):
        return sse_response(answer)
    from surge.server.http.common import ORJSONResponse

    return ORJSONResponse(answer.body, headers=answer.headers)


def sse_response(stream: EventStream) -> StreamingResponse:
    return StreamingResponse(stream.events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def send_sse(send, stream: EventStream) -> None:
    """`stream` straight to the ASGI server's `send`, as `sse_response` would send it (the generation
    hot path, server/http/generate_hotpath.py)."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    async for chunk in stream.events():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
