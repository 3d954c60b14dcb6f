"""Several generation streams answered as one (server/http/generate_choices.py): order within a stream,
every stream closed whatever ends the answer, seeds of n choices, the count limit."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from surge.errors import PayloadTooLarge, SurgeError
from surge.runtime.scheduler import SamplingParams
from surge.server.http.generate_choices import check_count, choice_params, first_deltas, merged


@dataclass
class D:
    text: str
    finish_reason: str | None = None


class Stream:
    """A real async generator with random delays, recording whether it was closed."""

    def __init__(self, name: str, n: int, fail_at: int | None = None, rng=None):
        self.name, self.n, self.fail_at, self.rng = name, n, fail_at, rng or random.Random(0)
        self.closed = False
        self.agen = self._run()

    async def _run(self):
        try:
            for i in range(self.n):
                await asyncio.sleep(self.rng.random() * 0.003)
                if i == self.fail_at:
                    raise SurgeError(f"{self.name} failed at {i}")
                yield D(f"{self.name}{i},", "stop" if i == self.n - 1 else None)
        finally:
            self.closed = True


def test_each_streams_deltas_in_order_and_all_finish():
    async def main(seed):
        rng = random.Random(seed)
        streams = [Stream(f"s{k}", rng.randint(1, 12), rng=rng) for k in range(5)]
        agens = [s.agen for s in streams]
        got: dict[int, str] = {}
        order = []
        async for i, d in merged(agens, await first_deltas(agens)):
            got[i] = got.get(i, "") + d.text
            order.append(i)
        assert got == {k: "".join(f"s{k}{j}," for j in range(s.n)) for k, s in enumerate(streams)}
        assert all(s.closed for s in streams)  # inside the loop: asyncio.run would close them itself
        return order

    orders = {tuple(asyncio.run(main(seed))) for seed in range(4)}
    assert any(list(o) != sorted(o) for o in orders)  # interleaved as they came, not one after another


def test_a_failing_first_delta_closes_every_stream():
    async def main():
        streams = [Stream("a", 5), Stream("b", 5, fail_at=0), Stream("c", 5)]
        with pytest.raises(SurgeError, match="b failed at 0"):
            await first_deltas([s.agen for s in streams])
        return [s.closed for s in streams]  # before asyncio.run's own shutdown closes what is left

    assert asyncio.run(main()) == [True, True, True]


def test_an_error_or_a_close_midway_closes_every_stream():
    async def fail():
        streams = [Stream("a", 30), Stream("b", 30, fail_at=3)]
        agens = [s.agen for s in streams]
        with pytest.raises(SurgeError, match="b failed at 3"):
            async for _ in merged(agens, await first_deltas(agens)):
                pass
        return [s.closed for s in streams]

    async def leave():
        streams = [Stream("a", 30), Stream("b", 30)]
        agens = [s.agen for s in streams]
        deltas = merged(agens, await first_deltas(agens))
        for _ in range(4):
            await deltas.__anext__()
        await deltas.aclose()  # the client left
        return [s.closed for s in streams]

    assert asyncio.run(fail()) == [True, True]
    assert asyncio.run(leave()) == [True, True]


def test_choice_params_and_the_count_limit():
    p = SamplingParams(temperature=0.7, seed=41)
    assert [c.seed for c in choice_params(p, 3)] == [41, 42, 43]
    assert all(c.temperature == 0.7 for c in choice_params(p, 3))
    unseeded = SamplingParams(temperature=0.7)
    assert choice_params(unseeded, 2) == [unseeded, unseeded]
    check_count(4, 5, 20)
    with pytest.raises(PayloadTooLarge):
        check_count(4, 6, 20)
