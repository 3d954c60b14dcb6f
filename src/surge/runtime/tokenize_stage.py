"""The tokenize stage: short inputs inline, the rest batched on one thread.

Measured on this project's 2-core machine: tokenizing one short sentence
takes ~65 us (`Tokenizer.encode`), while handing it to a thread and back costs
more than that under load, and one thread that tokenizes request after request
(the first version) queued them: 24 ms mean tokenize latency at 64 clients on
the GPU machine. So:

- a short request (<= `inline_chars` characters) is tokenized inline on the
  event loop when the tokenizer thread is idle: no hop, no queue;
- otherwise it joins a queue that the tokenizer thread drains whole: every
  request waiting is tokenized in one `encode_batch` call (the tokenizers
  library releases the GIL there and spreads the batch over its own threads),
  so a burst costs one call, and the loop keeps parsing HTTP meanwhile.

A request whose inputs fail (too long with truncate=false) fails alone: the
batch is retried per request then. Requests are tokenized together only with
requests of the same truncation (cut at the end, cut from the left, or not cut). Inline runs only while the thread is idle
(a request does not pass the ones queued before it), and only the loop starts
the thread. (The tokenizer itself is safe to call from several threads:
runtime/tokenize.py.)
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from surge.types import Encoded

# (texts, token ids, truncate, left): runtime/service.encode_inputs
Encode = Callable[[list[str] | None, list[list[int]] | None, bool, bool], list[Encoded]]


class TokenizeStage:
    def __init__(self, encode: Encode, name: str = "model", inline_chars: int = 512):
        self._encode = encode
        self.inline_chars = inline_chars
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"surge-{name}-tok")
        self._lock = threading.Lock()
        # (texts, (truncate, left), future, its loop)
        self._queue: list[tuple[list[str], tuple[bool, bool], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._busy = False
        self.batches = 0  # encode_batch calls made by the thread (for tests and benchmarks)
        self.inline = 0  # requests tokenized inline

    async def encode(self, texts: list[str] | None, token_ids: list[list[int]] | None, truncate: bool,
                     left: bool = False) -> list[Encoded]:
        """`left`: a too-long input keeps its last tokens (truncate=True only)."""
        if texts is None:
            return self._encode(None, token_ids, truncate, left)  # validation and numpy: cheap
        with self._lock:
            idle = not self._busy
        if idle and truncate and sum(map(len, texts)) <= self.inline_chars:
            self.inline += 1
            return self._encode(texts, None, truncate, left)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._queue.append((texts, (truncate, left), fut, loop))
            start = not self._busy
            self._busy = True
        if start:
            self._pool.submit(self._drain)
        return await fut

    async def off_loop(self, fn, *args):
        """Run another use of the tokenizer (e.g. counting without truncation) on the tokenizer
        thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _drain(self) -> None:
        while True:
            with self._lock:
                todo, self._queue = self._queue, []
                if not todo:
                    self._busy = False
                    return
            for mode in dict.fromkeys(x[1] for x in todo):  # each truncation once, in order of arrival
                group = [x for x in todo if x[1] == mode and not x[2].done()]
                if group:
                    self._run(group, *mode)

    def _run(self, group, truncate: bool, left: bool) -> None:
        flat = [t for texts, _, _, _ in group for t in texts]
        self.batches += 1
        try:
            encs = self._encode(flat, None, truncate, left)
        except Exception:  # noqa: BLE001 - one request's bad input: each request alone, errors to their own
            for texts, _, fut, loop in group:
                try:
                    res = self._encode(texts, None, truncate, left)
                except Exception as exc:  # noqa: BLE001
                    loop.call_soon_threadsafe(_set, fut, None, exc)
                else:
                    loop.call_soon_threadsafe(_set, fut, res, None)
            return
        at = 0
        for texts, _, fut, loop in group:
            loop.call_soon_threadsafe(_set, fut, encs[at:at + len(texts)], None)
            at += len(texts)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)


def _set(fut: asyncio.Future, result, exc) -> None:
    if fut.done():
        return  # the caller went away (cancelled, deadline)
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
