"""Every token's last hidden state (TEI's POST /embed_all), under the admission control /embed has.

    admit (the service's Admission: 429 past its bound, as /embed) -> tokenize (the service's stage) ->
    size check (413 past --max-token-states-bytes, before any compute) -> the engines: on the service's
    one thread for per-token runs (in this process), or over the IPC to the engine process (--workers), which
    admits the request again under its own bound (every front end's requests meet there)

Not through the dynamic batcher nor the cache: per-token rows are n_tokens times a pooled row, and a
request's rows are computed from its own inputs only (ModelWorker.token_states: one input per engine
run), so they never depend on other requests, nor on the other inputs of the same request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from surge.errors import DeadlineExceeded, NotReady, ResultTooLarge, Unsupported
from surge.runtime.outcome import admitted
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


async def token_states(service, texts: list[str], truncate: bool, left: bool = False,
                       prompt_name: str | None = None) -> list[np.ndarray]:
    """Each text's last hidden state [n_tokens, hidden] float32 (special tokens included), in order."""
    if not service.can_return_tokens:
        raise unsupported(service.name)
    inputs = service.prompted(texts, prompt_name)
    deadline = time.monotonic() + service.limits.request_timeout_s
    with admitted(service, len(inputs)):
        async with _until(deadline, service.limits.request_timeout_s):
            items = await service.tokenize.encode(inputs, None, truncate, left)  # too long, no truncate: 422
            check_size(items, service.dimensions, service.limits.max_token_states_bytes)
            return await _compute(service, items, deadline)


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
