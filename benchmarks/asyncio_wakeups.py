"""The floor under GenerateService's event loop at N streams: one callback a step sets N futures, each
stream's coroutine (an async generator, as service.stream() is, under `depth - 1` wrapping generators,
as the HTTP routes add) wakes, takes its item and awaits a new future. Nothing else: no detokenization,
no metrics, no consumer work.

    python3 benchmarks/asyncio_wakeups.py --streams 64 --steps 2000 --depth 1 2 5

Prints the event loop's CPU time per step (process time; run it pinned to one core).
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def _run(streams: int, steps: int, depth: int) -> float:
    loop = asyncio.get_running_loop()

    class H:
        __slots__ = ("item", "waiter")

        def __init__(self):
            self.item, self.waiter = None, None

    hs = [H() for _ in range(streams)]

    async def base(h):
        for _ in range(steps):
            while h.item is None:
                h.waiter = loop.create_future()
                await h.waiter
            item, h.item = h.item, None
            yield item

    async def wrap(g):
        try:
            async for x in g:
                yield x
        finally:
            await g.aclose()

    async def consume(h):
        g = base(h)
        for _ in range(depth - 1):
            g = wrap(g)
        async for _ in g:
            pass

    tasks = [asyncio.ensure_future(consume(h)) for h in hs]
    await asyncio.sleep(0)
    done = [0]

    def deliver():
        for h in hs:
            h.item = 1
            w = h.waiter
            if w is not None and not w.done():
                w.set_result(None)
        done[0] += 1
        if done[0] < steps:
            loop.call_soon(deliver)

    t = time.process_time()
    loop.call_soon(deliver)
    await asyncio.gather(*tasks)
    return (time.process_time() - t) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--depth", type=int, nargs="+", default=[1, 2, 5])
    args = ap.parse_args(argv)
    for d in args.depth:
        per = asyncio.run(_run(args.streams, args.steps, d))
        print(f"depth {d}: {1e6 * per:.1f} us CPU a step, {1e6 * per / args.streams:.2f} us a stream")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
