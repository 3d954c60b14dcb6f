"""A request that fails is freed as soon as its answer is sent, by reference counting: no reference cycle
keeps it until a full garbage collection (which would then walk all of it: a 2 MB conversation's 90,000
objects, ~40 ms holding the GIL, and its memory held meanwhile)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from surge.errors import InvalidInput
from surge.server.http.generate_common import until_disconnect


class Body:
    """Stands for a request's parsed body."""


@pytest.fixture
def no_collector():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_failed_generation_under_until_disconnect_leaves_no_cycle(no_collector):
    refs = []

    async def generation(body):  # as service.generate failing its check (the prompt over the context)
        await asyncio.sleep(0)
        raise InvalidInput("the prompt has 498918 tokens; this model's context is 256 tokens")

    async def never_disconnects():
        await asyncio.Event().wait()

    async def answer():  # as a route's answer: the body is one of its locals
        body = Body()
        refs.append(weakref.ref(body))
        return await until_disconnect(never_disconnects, generation(body))

    async def main():
        try:
            await answer()
        except InvalidInput:
            pass
        await asyncio.sleep(0)  # the watcher's cancellation runs
        return refs[0]() is None

    assert asyncio.run(main()), "the failed request's body is kept alive by a reference cycle"
