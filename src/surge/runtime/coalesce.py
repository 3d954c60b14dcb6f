"""Single-flight for cache misses: one computation per key, however many ask at once.

Hot queries arrive in bursts. Before the first answer reaches the cache, every
concurrent request for the same text would otherwise tokenize and run it again.
Here the first request to miss a key owns it (the leader) and the others wait
for its result (followers), each within its own deadline. A leader that fails
(its deadline, its client gone, an engine error) does not fail the followers:
they get None and compute the input themselves.

Keys are the cache's keys, so they already hold the model version and every
option that changes the output.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from surge.errors import DeadlineExceeded


@dataclass
class Claim:
    lead: list[int] = field(default_factory=list)  # input positions this request computes
    mine: dict = field(default_factory=dict)  # key -> (future, position) this request owns
    follow: dict = field(default_factory=dict)  # future -> positions waiting on another computation


class InFlight:
    def __init__(self):
        self._futures: dict = {}

    def __len__(self) -> int:
        return len(self._futures)

    def claim(self, keys: list, miss: list[int]) -> Claim:
        loop = asyncio.get_running_loop()
        c = Claim()
        for i in miss:
            k = keys[i]
            fut = self._futures.get(k)
            if fut is None:
                fut = self._futures[k] = loop.create_future()
                c.mine[k] = (fut, i)
                c.lead.append(i)
            else:  # another request's, or a duplicate inside this one
                c.follow.setdefault(fut, []).append(i)
        return c

    def settle(self, c: Claim, vectors: list, tokens: list, ok: bool) -> None:
        """Hand the leader's results (or, on failure, None) to its followers and release the keys."""
        for k, (fut, i) in c.mine.items():
            if not fut.done():
                fut.set_result((vectors[i], tokens[i]) if ok else None)
            if self._futures.get(k) is fut:
                del self._futures[k]

    @staticmethod
    async def wait(c: Claim, vectors: list, tokens: list, deadline: float) -> tuple[list[int], int]:
        """Fill the followed positions; returns (positions to compute after all, positions filled)."""
        retry, filled = [], 0
        for fut, positions in c.follow.items():
            try:
                # shield: a follower that gives up must not cancel the leader's future
                res = await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise DeadlineExceeded("the request's deadline passed while an identical input was computed") from None
            if res is None:
                retry.extend(positions)
                continue
            vec, ntok = res
            for i in positions:
                vectors[i], tokens[i] = vec, ntok
            filled += len(positions)
        return retry, filled
