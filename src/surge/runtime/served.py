"""A ModelService as the router sees it: it counts the calls in flight so that
an unloaded or replaced version can be drained before it is freed.

The counter lives here, outside ModelService, so the service's internals
(batcher, cache) can change freely: only its public API is used.
"""

from __future__ import annotations

import asyncio
import contextlib


class ServedModel:
    """Forwards everything to the service; `embed` is counted."""

    def __init__(self, service):
        self.service = service
        self.inflight = 0
        self.retired = False  # no longer routed to; draining or closed
        self._idle = asyncio.Event()
        self._idle.set()

    def __getattr__(self, item):
        # Only reached for attributes not defined here: name, version, ready, spec...
        return getattr(self.service, item)

    def __repr__(self) -> str:
        return f"ServedModel({self.service.name!r}, version={self.service.version!r}, inflight={self.inflight})"

    async def embed(self, *args, **kwargs):
        self.inflight += 1
        self._idle.clear()
        try:
            return await self.service.embed(*args, **kwargs)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def infer(self, *args, **kwargs):
        """Task models (classify, rerank, token-classify; tensor models): counted as embed is."""
        self.inflight += 1
        self._idle.clear()
        try:
            return await self.service.infer(*args, **kwargs)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    # generation (task "generate"): counted too, so a replaced version finishes its streams
    async def generate(self, *args, **kwargs):
        self.inflight += 1
        self._idle.clear()
        try:
            return await self.service.generate(*args, **kwargs)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def stream(self, *args, **kwargs):
        self.inflight += 1
        self._idle.clear()
        try:
            async for delta in self.service.stream(*args, **kwargs):
                yield delta
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def warmup(self, text: str) -> None:
        """One call through the full path of the model's task (tokenizer, batcher, engine, heads), not
        counted as a client's request on /metrics (as it is not in the KServe statistics)."""
        metrics = getattr(self.service, "metrics", None)
        with metrics.quiet() if hasattr(metrics, "quiet") else contextlib.nullcontext():
            if getattr(self.service, "task", "embed") == "embed":
                await self.embed(texts=[text])
                return
            from surge.runtime.tasks import TaskRequest

            pairs = [(text, text)] if self.service.task == "rerank" else None
            await self.infer(TaskRequest(texts=None if pairs else [text], pairs=pairs, truncate=True))

    async def drain(self, grace_s: float = 0.2) -> None:
        """Wait until no call is in flight. Call after routing has moved away.

        The grace period covers a request that has already looked the model up
        but whose `embed` has not started yet (one event-loop hop in the route).
        """
        self.retired = True
        await asyncio.sleep(grace_s)
        while True:
            while self.inflight:
                await self._idle.wait()
                # A caller that looked the model up just before it was retired may
                # start right after the last one ends: look once more.
                await asyncio.sleep(0)
            if not self._uncounted():
                return
            await asyncio.sleep(0.02)  # no event to wait on: polled

    def _uncounted(self) -> int:
        """Calls under way that never passed through here, where the service counts its own (`inflight`): a
        decoder's LoRA adapters are views of the service itself (runtime/lora_adapters.AdapterView),
        registered and called beside this wrapper, and their streams run on the engine close() stops."""
        return int(getattr(self.service, "inflight", 0) or 0)

    async def close(self) -> None:
        self.retired = True
        await self.service.close()
