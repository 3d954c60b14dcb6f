"""What the HTTP and gRPC layers share: config, the model registry, readiness."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from surge.config import ServerConfig
from surge.errors import DeadlineExceeded
from surge.runtime.registry import ModelRegistry
from surge.runtime.service import ModelService
from surge.types import EmbedOptions, EmbedResult


@dataclass
class AppState:
    config: ServerConfig
    registry: ModelRegistry
    started: bool = False
    extras: dict = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.started and self.registry.ready

    async def run(self, service: ModelService, *, texts=None, token_ids=None,
                  options: EmbedOptions | None = None) -> EmbedResult:
        """Call a model with the request timeout; a late answer becomes 504."""
        timeout = self.config.limits.request_timeout_s
        try:
            return await asyncio.wait_for(service.embed(texts=texts, token_ids=token_ids, options=options), timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"request did not finish within {timeout:g} s") from None
