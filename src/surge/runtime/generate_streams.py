"""The event-loop side of a GenerateService's streams: each sequence's handle, one engine iteration's
tokens turned into every stream's delta in one pass (text, stop strings, log-probabilities, metrics),
and the failures that end streams. The engine thread reports here (_ThreadOutbox); an engine
process's reports arrive through GenerateService._on_message.

A mixin of GenerateService (runtime/generate_service.py), apart from it because this is the per-token
work, which does not depend on where the engine loop runs. Needs the service's `_handles`, `metrics`,
`engine`, `tokenizer`, `decode`, `decode_all`, `_abort` and `_set_state`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import cached_property
from typing import TYPE_CHECKING

from surge.errors import DeadlineExceeded, EngineError, InvalidInput, NotReady
from surge.runtime.detok import TextState
from surge.runtime.generate_core import ENGINE, INVALID
from surge.runtime.generate_delta import Delta
from surge.runtime.scheduler import Sequence

if TYPE_CHECKING:
    from surge.runtime.generate_service import GenerateService

log = logging.getLogger("surge.generate")


class _Handle:
    """The event-loop side of one sequence: its text and counts, the delta built from the tokens
    delivered since its coroutine last ran (merged: tokens that arrive together reach the client
    together), an error to raise, and the future the coroutine sleeps on (no task or queue per
    token)."""

    __slots__ = ("seq", "state", "stops", "logprobs", "prompt_tokens", "start", "first", "last", "n_out",
                 "delta", "error", "waiter", "done")

    def __init__(self, seq: Sequence, state: TextState, stops: frozenset, start: float):
        self.seq = seq
        self.state = state
        self.stops = stops
        self.logprobs = seq.params.logprobs is not None
        self.prompt_tokens = len(seq.prompt_ids)
        self.start = self.first = self.last = start
        self.n_out = 0
        self.delta: Delta | None = None
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None
        self.done = False  # finished (its metrics counted) or failed: later tokens are dropped

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, err: Exception) -> None:
        if self.error is None:
            self.error = err
        self.wake()

    def expire(self) -> None:
        self.fail(DeadlineExceeded("generation did not finish within the request deadline"))


class StreamDelivery:
    def _deliver(self, batch, admitted=None) -> None:
        """One engine iteration's tokens ([(tokens {seq_id: token}, samples {seq_id: SampleOut} or
        None, finished {seq_id: reason} or None)]) -> every stream's delta, in one pass; the streams
        with a new delta are woken. `admitted`: {seq_id: (scheduled_at, prompt tokens found in the prefix
        cache)} of sequences first scheduled since the last call (the engine process's copies carry them; a
        thread's are these objects).
        Inter-token latency is the gap between the steps that delivered a stream's tokens, observed in
        bulk once a call (a Prometheus observe per token was a large share of the event loop's work at
        64 streams)."""
        now = time.monotonic()
        handles = self._handles
        if admitted:
            for sid, (t, cached) in admitted.items():
                h = handles.get(sid)
                if h is not None:
                    h.seq.scheduled_at, h.seq.num_cached_prompt = t, cached
        itl: list[float] = []
        count = 0
        metrics = self.metrics
        for tokens, samples, finished in batch:
            for sid, token in tokens.items():
                h = handles.get(sid)
                if h is None or h.done or h.error is not None:
                    continue
                try:
                    finish = finished.get(sid) if finished else None
                    n = h.n_out
                    if n:
                        itl.append(now - h.last)
                    else:
                        metrics.ttft.observe(now - h.start)
                        h.first = now
                    h.last = now
                    h.n_out = n = n + 1
                    count += 1
                    state = h.state
                    if finish == "stop" and token in h.stops:
                        text = state.flush()  # the stop token itself is not text
                    else:
                        text = state.add(token, final=finish is not None)
                        if state.stopped:
                            # a stop string ended the text: "stop", also where the engine ended the
                            # sequence with this very token (at max_tokens: its "length")
                            if finish is None:
                                self._abort(h, "stop")
                            finish = "stop"
                        if finish is not None:
                            text += state.flush()
                    lp = None
                    out = samples.get(sid) if samples else None
                    if h.logprobs and out is not None:
                        lp = self._logprob(token, out.logprob, out.top, h.seq.params.skip_special_tokens,
                                           out.rank)
                    d = h.delta
                    if d is None:
                        lps = ([lp] if lp is not None else []) if h.logprobs else None
                        h.delta = d = Delta(text, [token], lps, finish, h.prompt_tokens, n)
                    else:  # the stream has not taken its last delta yet: one delta, as if delivered together
                        d.text += text
                        d.token_ids.append(token)
                        if lp is not None:
                            d.logprobs.append(lp)
                        d.finish_reason, d.completion_tokens = finish, n
                    if out is not None and out.prompt is not None:
                        d.prompt_logprobs = [self._logprob(t, v, top, h.seq.params.skip_special_tokens, rank)
                                              for t, v, top, rank in out.prompt]
                    if finish is not None:
                        d.cached_tokens = h.seq.num_cached_prompt
                    if finish == "stop":
                        named = token in h.seq.params.stop_token_ids  # vLLM: a named id even if it is an EOS
                        d.stop_reason = state.matched if state.stopped else \
                            (token if named or token not in self.engine.cfg.eos_token_ids else None)
                    if finish is not None:
                        h.done = True
                        queued_until = h.seq.scheduled_at or h.start
                        d.timings = {"queue_ns": int(1e9 * max(0.0, queued_until - h.start)),
                                     "compute_input_ns": int(1e9 * max(0.0, h.first - queued_until)),
                                     "compute_infer_ns": int(1e9 * max(0.0, h.last - h.first))}
                        metrics.finished(finish)
                    h.wake()
                except Exception as exc:  # this stream's failure (its text, say), not its neighbours'
                    log.exception("stream %s failed", sid)
                    h.fail(exc)
        if itl:
            metrics.observe_itl(itl)
        if count:
            metrics.output.inc(count)

    def _logprob(self, token: int, logprob: float, top, skip_special: bool = True, rank: int | None = None) -> dict:
        """A token's log-probability entry; its text (and its alternatives') as the request's answer writes
        special tokens: left out, or written out where it asked for skip_special_tokens false."""
        top = top or []
        text = self.decode if skip_special else self.decode_all
        return {"token_id": token, "token": text([token]), "logprob": logprob, "rank": rank,
                "top": [(text([t]), v, t) for t, v in top], "bytes": self._bytes_of(token, text),
                "top_bytes": [self._bytes_of(t, text) for t, _ in top]}

    @cached_property
    def _token_bytes(self) -> list:
        """Built at the first request for log-probabilities (a pass over the vocabulary)."""
        from surge.runtime.token_bytes import token_bytes_table

        return token_bytes_table(self.tokenizer)

    def _bytes_of(self, token: int, text=None) -> list[int]:
        own = self._token_bytes[token] if 0 <= token < len(self._token_bytes) else None
        return list(own if own is not None else (text or self.decode)([token]).encode())

    def _expire(self, handle: _Handle) -> None:
        """The request's deadline passed: its stream fails, and its sequence stops now, not when its
        consumer next waits (one held up writing to a client that does not read may not for long)."""
        if handle.done or handle.error is not None:
            return
        handle.expire()
        self._abort(handle, "abort")  # (the stream's end sends it again: a no-op in the engine loop)

    def _fail(self, seq_id: int, err: Exception) -> None:
        h = self._handles.get(seq_id)
        if h is not None and not h.done:
            h.fail(err)

    def _fail_streams(self, err: Exception) -> None:
        for h in list(self._handles.values()):
            if not h.done:
                h.fail(err)


def _error(kind: str, message: str) -> Exception:
    return InvalidInput(message, param="prompt") if kind == INVALID else \
        EngineError(message) if kind == ENGINE else NotReady(message)


class _ThreadOutbox:
    """The engine thread's reports: state set here, tokens and errors handed to the event loop."""

    def __init__(self, service: GenerateService):
        self.service = service

    def tokens(self, batch, admitted, state) -> None:
        svc = self.service
        svc._set_state(state)
        if svc._loop is not None:
            svc._loop.call_soon_threadsafe(svc._deliver, batch, admitted)

    def error(self, seq_id: int, kind: str, message: str) -> None:
        svc = self.service
        if svc._loop is not None:
            svc._loop.call_soon_threadsafe(svc._fail, seq_id, _error(kind, message))

    def state(self, state) -> None:
        self.service._set_state(state)
