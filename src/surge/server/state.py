"""What the HTTP and gRPC layers share: config, the model registry, readiness."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from surge.config import ServerConfig
from surge.errors import DeadlineExceeded, NotReady, SurgeError
from surge.runtime.registry import ModelRegistry
from surge.runtime.service import ModelService
from surge.runtime.stats import InferenceStats
from surge.types import EmbedOptions, EmbedResult


class ModelLifecycle(Protocol):
    """Loading and unloading models at run time (the repository implements it).

    Errors are SurgeErrors: NotFound for an unknown model or version, ConfigError
    for an invalid model.yaml, EngineError when loading fails (the version being
    served stays untouched then).
    """

    async def index(self) -> list[dict]:
        """Every model the repository knows: {"name", "version", "state", "reason"};
        state is one of READY, LOADING, UNAVAILABLE (KServe's repository index)."""
        ...

    async def load(self, name: str, version: str | None = None) -> None:
        """Load (or reload) a model; returns once it is warmed up and serving."""
        ...

    async def unload(self, name: str, version: str | None = None) -> None:
        """Stop routing to the model, drain in-flight requests, free it."""
        ...


@dataclass
class AppState:
    config: ServerConfig
    registry: ModelRegistry
    started: bool = False
    lifecycle: ModelLifecycle | None = None
    extras: dict = field(default_factory=dict)
    stats: InferenceStats = field(default_factory=InferenceStats)

    @property
    def ready(self) -> bool:
        return self.started and self.registry.ready

    async def run(self, service: ModelService, *, texts=None, token_ids=None,
                  options: EmbedOptions | None = None) -> EmbedResult:
        """Call a model with the request timeout; a late answer becomes 504.
        Every call is counted in `stats` (KServe v2 statistics), whatever its protocol."""
        timeout = self.config.limits.request_timeout_s
        start = time.perf_counter_ns()
        try:
            result = await asyncio.wait_for(self._embed(service, texts, token_ids, options), timeout)
        except asyncio.TimeoutError:
            self.stats.record_failure(service.name, service.version, time.perf_counter_ns() - start)
            raise DeadlineExceeded(f"request did not finish within {timeout:g} s") from None
        except Exception:
            self.stats.record_failure(service.name, service.version, time.perf_counter_ns() - start)
            raise
        self.stats.record_success(service.name, service.version, result, time.perf_counter_ns() - start,
                                  cache_enabled=bool(getattr(getattr(service, "cache_cfg", None), "enabled", False)))
        return result

    async def _embed(self, service, texts, token_ids, options):
        try:
            return await service.embed(texts=texts, token_ids=token_ids, options=options)
        except NotReady:
            # The copy this request looked up was replaced (a reload) between the lookup and
            # the call, e.g. while the request body was still arriving: the new copy answers.
            # NotReady is raised before any work is admitted, so the call is safe to repeat.
            try:
                current = self.registry.get(service.name, service.version)
            except SurgeError:
                current = service
            if current is service:
                raise
            return await current.embed(texts=texts, token_ids=token_ids, options=options)
