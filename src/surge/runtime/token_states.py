"""Every token's last hidden state (TEI's POST /embed_all), under the admission control /embed has.

    admit (the service's Admission: 429 past its bound, as /embed) -> tokenize (the service's stage) ->
    size check (413 past --max-token-states-bytes, before any compute) -> the engines: on the service's
    one thread for per-token runs (in this process), or over the IPC to the engine process (--workers), which
    admits the request again under its own bound (every front end's requests meet there)

The admission slot is held past the compute, for as long as the caller holds the answer (`held`): the
HTTP route keeps it until the answer's JSON (about 3x its float rows) is serialized and the kernel has taken
its last byte, which it does only as fast as the client reads (server/http/held_answer.py).
So what /embed_all answers hold in memory is bounded by admission, as their compute is: clients that ask
for big answers and read them slowly take slots, and past the bound the next request is a 429 rather
than one more answer in memory. Counted once, as /embed is: requests, inputs and failures by `admitted`,
the latency here (to the computed answer, observed once the block ends without error: an answer whose
connection was lost before its last byte was the kernel's is a failure "cancelled", not answered), the
KServe statistics by AppState.call from the TokenStates' timings.

Not through the dynamic batcher nor the cache: per-token rows are n_tokens times a pooled row, and a
request's rows are computed from its own inputs only (ModelWorker.token_states: one input per engine
run), so they never depend on other requests, nor on the other inputs of the same request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from surge.errors import DeadlineExceeded, NotReady, ResultTooLarge, Unsupported
from surge.runtime.outcome import admitted
from surge.runtime.request import EXECUTIONS
from surge.types import Encoded

FLOAT_BYTES = 4  # the rows are float32


def check_size(items: list[Encoded], hidden: int, limit: int) -> int:
    """The answer's float32 bytes, or ResultTooLarge (413) past `limit`."""
    tokens = sum(len(e) for e in items)
    size = tokens * hidden * FLOAT_BYTES
    if size > limit:
        raise ResultTooLarge(f"the answer would hold {tokens} tokens x {hidden} floats ({size} bytes), more than "
                             f"--max-token-states-bytes ({limit}): send fewer or shorter inputs", param="inputs")
    return size


def unsupported(name: str) -> Unsupported:
    return Unsupported(f"model '{name}' has no per-token hidden state to return (its engines pool or run heads "
                       "inside their graph)", param="model")


@dataclass
class TokenStates:
    """One request's answer, in the shape the KServe statistics record (runtime/stats.record_success):
    `vectors` has one [n_tokens, hidden] float32 array per input, `timings` its stages (ns) and its
    engine runs (one per input: ModelWorker.token_states)."""

    vectors: list[np.ndarray]
    timings: dict = field(default_factory=dict)


async def token_states(service, texts: list[str], truncate: bool, left: bool = False,
                       prompt_name: str | None = None) -> list[np.ndarray]:
    """Each text's last hidden state [n_tokens, hidden] float32 (special tokens included), in order; the
    admission slot is released on return (`held` keeps it for as long as the answer is held)."""
    async with held(service, texts, truncate, left, prompt_name) as answer:
        return answer.vectors


@contextlib.asynccontextmanager
async def held(service, texts: list[str], truncate: bool, left: bool = False, prompt_name: str | None = None,
               deadline: float | None = None):
    """`async with held(...) as answer`: token_states' rows as a TokenStates, computed within `deadline`
    (time.monotonic(); default: now + the request timeout), with the request's admission slot held until
    the block ends, however it ends: the caller serializes and sends the answer inside."""
    if not service.can_return_tokens:
        raise unsupported(service.name)
    inputs = service.prompted(texts, prompt_name)
    start = time.monotonic()
    if deadline is None:
        deadline = start + service.limits.request_timeout_s
    with admitted(service, len(inputs)):
        async with _until(deadline, service.limits.request_timeout_s):
            t0 = time.perf_counter_ns()
            items = await service.tokenize.encode(inputs, None, truncate, left)  # too long, no truncate: 422
            check_size(items, service.dimensions, service.limits.max_token_states_bytes)
            t1 = time.perf_counter_ns()
            rows = await _compute(service, items, deadline)
            t2 = time.perf_counter_ns()
        # as /embed's: the runtime's latency, to the computed answer (its sending is the client's pace), observed
        # once the block ends without error (the HTTP route's: its answer delivered, server/http/held_answer.py),
        # so that an answer cut short is a failure only, not also an answered request's latency
        latency = time.monotonic() - start
        yield TokenStates(rows, {"compute_input_ns": t1 - t0, "compute_infer_ns": t2 - t1, EXECUTIONS: len(items)})
        service.metrics.latency.observe(latency)


async def of_tokens(service, items: list[Encoded], deadline: float | None) -> list[np.ndarray]:
    """The engine process's side (--workers): a front end's tokenized inputs, admitted here too (every front
    end's requests meet here), but not counted again: the front end's metrics counted the request."""
    if deadline is None:
        deadline = time.monotonic() + service.limits.request_timeout_s
    if not service.ready:
        raise NotReady(f"model {service.name} version {service.version} is not ready")
    check_size(items, service.dimensions, service.limits.max_token_states_bytes)
    service.admission.admit(len(items))  # 429 past the bound
    try:
        async with _until(deadline, service.limits.request_timeout_s):
            return await _compute(service, items, deadline)
    finally:
        service.admission.release(len(items))


async def _compute(service, items: list[Encoded], deadline: float) -> list[np.ndarray]:
    remote = getattr(service.batcher, "token_states", None)  # a front end's: the engine process computes
    if remote is not None:
        return await remote(items, deadline)
    if not service.worker.can_return_tokens:
        raise unsupported(service.name)
    # On the service's thread for per-token runs: a request waiting for it is dropped before it starts if
    # its deadline passes or its client goes away (the future is cancelled).
    return await service.on_states_thread(service.worker.token_states, items)


@contextlib.asynccontextmanager
async def _until(deadline: float, timeout_s: float):
    """asyncio.timeout_at at a time.monotonic() deadline, as DeadlineExceeded (504)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
            yield
    except TimeoutError:
        raise DeadlineExceeded(f"request did not finish within {timeout_s:g} s") from None
