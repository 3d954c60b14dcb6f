"""A ModelService as the router sees it: it counts the calls in flight so that
an unloaded or replaced version can be drained before it is freed.

The counter lives here, outside ModelService, so the service's internals
(batcher, cache) can change freely: only its public API is used.
"""

from __future__ import annotations

import asyncio


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
        """Tensor models (runtime/tensor_service.py): counted as embed is."""
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

    async def drain(self, grace_s: float = 0.2) -> None:
        """Wait until no call is in flight. Call after routing has moved away.

        The grace period covers a request that has already looked the model up
        but whose `embed` has not started yet (one event-loop hop in the route).
        """
        self.retired = True
        await asyncio.sleep(grace_s)
        while self.inflight:
            await self._idle.wait()
            # A caller that looked the model up just before it was retired may
            # start right after the last one ends: look once more.
            await asyncio.sleep(0)

    async def close(self) -> None:
        self.retired = True
        await self.service.close()
