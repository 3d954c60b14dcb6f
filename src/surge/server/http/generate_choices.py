"""Several generations answered as one request: OpenAI's `n` choices of a prompt, and a completions
request's list of prompts, streamed or not.

Each choice is a sequence of its own in the engine (the prompt's blocks shared through the prefix
cache), so a choice's tokens never depend on its siblings. A seeded request's choice j samples with
seed + j (vLLM's rule): the choices differ, and each is reproducible.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

from surge.errors import PayloadTooLarge
from surge.runtime.scheduler import SamplingParams


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling parameters of a prompt's `n` choices, in choice order."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + j) for j in range(n)]


def check_count(prompts: int, n: int, limit: int) -> None:
    """A request's choices in all count against `max_inputs_per_request` (413 beyond)."""
    if prompts * n > limit:
        raise PayloadTooLarge(f"{prompts} prompt(s) x n={n} is {prompts * n} generations; at most {limit} are "
                              "allowed in one request", param="n")


async def first_deltas(agens: list) -> list:
    """The first delta of every stream, awaited before the answer's headers so that an error before any
    output (429, 400, 504) keeps its HTTP status. If one fails, every stream is closed."""
    if len(agens) == 1:  # the common case, without a task a request
        return [await agens[0].__anext__()]
    tasks = [asyncio.ensure_future(a.__anext__()) for a in agens]
    try:
        return [await t for t in tasks]
    except BaseException:
        await _close(tasks, agens)
        raise


async def merged(agens: list, firsts: list) -> AsyncIterator[tuple[int, object]]:
    """(index, delta) of every stream as it comes, each stream's own deltas in order, until every stream
    has passed its finishing delta; `firsts` are `first_deltas(agens)`. Closing this closes them all."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, d in enumerate(firsts):
            yield i, d
        if len(agens) == 1:
            d = firsts[0]
            while d.finish_reason is None:
                d = await agens[0].__anext__()
                yield 0, d
            return
        for i, d in enumerate(firsts):
            if d.finish_reason is None:
                pending[asyncio.ensure_future(agens[i].__anext__())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=pending.__getitem__):
                i = pending.pop(t)
                d = t.result()
                yield i, d
                if d.finish_reason is None:
                    pending[asyncio.ensure_future(agens[i].__anext__())] = i
    finally:
        await _close(list(pending), agens)


async def _close(tasks, agens) -> None:
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    for a in agens:
        await a.aclose()
