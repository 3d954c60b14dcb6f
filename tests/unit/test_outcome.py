"""runtime/outcome.count_failures: each kind of failure counted under its code, the exception kept."""

import asyncio

import pytest

from surge.errors import InvalidInput, NotReady
from surge.runtime.outcome import count_failures


class Recorder:
    def __init__(self):
        self.codes = []

    def failure(self, code):
        self.codes.append(code)


@pytest.mark.parametrize("exc, code", [(InvalidInput("bad"), "invalid_input"), (NotReady("later"), NotReady.code),
                                       (asyncio.CancelledError(), "cancelled"), (KeyError("x"), "internal_error")])
def test_each_failure_is_counted_once_and_raised(exc, code):
    m = Recorder()
    with pytest.raises(type(exc)):
        with count_failures(m):
            raise exc
    assert m.codes == [code]


def test_success_counts_nothing():
    m = Recorder()
    with count_failures(m):
        value = 1 + 1
    assert value == 2 and m.codes == []


def test_inside_a_coroutine_a_cancellation_is_counted():
    m = Recorder()

    async def work():
        with count_failures(m):
            await asyncio.sleep(10)

    async def main():
        task = asyncio.create_task(work())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert m.codes == ["cancelled"]
