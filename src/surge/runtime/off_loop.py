"""A large request's preparation off the event loop: parsing, validation, the chat template's render,
tokenization, bad words, a guide's compile, the engine message.

That work grows with the request: one 2 MB body (100,000 bad_words, a chat of 45,000 messages, a 1.5 MB
grammar) held the event loop of its front end for about a second, and no other request on that process was
answered meanwhile (benchmarks/loop_stall.py). On a thread it no longer does: tokenizers and llguidance
release the GIL for their native work, and Python work on a thread lets the loop run at every GIL switch
interval instead of once at the end.

A small request stays on the loop: a hop to a thread and back costs ~22 us of CPU (2-core VM, uvloop),
3% of a streamed completion's ~0.75 ms, so only bodies above OFF_LOOP_BYTES (whose work inline would cost
milliseconds) pay it. Native calls that keep the GIL still hold the loop while they run, so the long ones are
cut short: a union's list choices stop at their first bad item (server/http/fail_fast.items: a 900k-id prompt's
validation held it ~180 ms), a long list of messages is validated with a Python call per message
(server/http/gil_points.py), the tokenizer lets it go and keeps no offsets to free (runtime/generate_text.py).
What is left for a 2 MB body is orjson's decode (~10-15 ms on the VM) and full garbage collections of its
objects (~10 ms each; benchmarks/prep_gil_holds.py). The threads are few and this module's own: a
burst of large requests waits for them in turn, while the small ones and everything else that runs on the
default executor do not.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

# Above this many bytes of body a request is prepared on a thread. Preparation costs ~1 us a byte of body
# (100,000 bad_words in 0.9 MB: ~1 s), so inline at most a few ms, and a thread's hop is then a small share
# of the request's own cost.
OFF_LOOP_BYTES = 8 * 1024
# Two: one large request whose native work holds its thread does not stall every other; more would share
# the GIL with the loop among more Python-heavy threads (the loop waits a switch interval for each).
THREADS = 2

_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(THREADS, thread_name_prefix="surge-prepare")
    return _executor


async def off_loop(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on a preparation thread, in a copy of this task's context (its context variables), its
    result or exception as if called here."""
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_pool(), call)


async def prepared(size: int | None, fn: Callable[..., T], *args) -> T:
    """`fn(*args)`: here for a request of at most OFF_LOOP_BYTES, on a preparation thread (off_loop) for a
    larger one or one of unknown size."""
    if size is not None and size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await off_loop(fn, *args)
