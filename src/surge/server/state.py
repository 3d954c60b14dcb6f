"""What the HTTP and gRPC layers share: config, the model registry, readiness."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from surge.config import ServerConfig
from surge.errors import DeadlineExceeded, NotReady, SurgeError
from surge.runtime.metrics import multiprocess_dir
from surge.runtime.outcome import CANCELLED, Delivery, awaited, awaiting, stop_awaiting
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
    # Whole across front ends under --workers (runtime/stats.py): the metrics directory is shared.
    stats: InferenceStats = field(default_factory=lambda: InferenceStats(multiprocess_dir()))

    @property
    def ready(self) -> bool:
        return self.started and self.registry.ready

    async def run(self, service, *, texts=None, token_ids=None,
                  options: EmbedOptions | None = None, check=None) -> EmbedResult:
        """The one entry point of every protocol (HTTP fast path, FastAPI routes, gRPC) for
        embeddings; task and tensor models come in through `call` too. `check(result)`: a protocol's
        own refusal of a computed answer (the OpenAI route's too-long input), awaited inside the
        accounting: its error is the request's failure, under its code, not a success, and the request
        counts once: the runtime's count of it answered is held until the check has passed (`_checked`)."""
        if check is None:
            return await self.call(service, lambda deadline: self._embed(service, texts, token_ids, options,
                                                                         deadline))

        async def checked(deadline):
            return await _checked(self._embed(service, texts, token_ids, options, deadline), check)

        return await self.call(service, checked)

    async def call(self, service, invoke):
        """Every served-model call (embed, task heads, tensor models): one deadline and one record.

        `invoke(deadline)` starts the call; `deadline` (time.monotonic()) is None for a model that
        takes none (a remote one, behind the Ray ingress). A local embedding model enforces the
        deadline itself (504 past it); any other call is also bounded here, at the same instant.
        Every call is counted once in `stats` (KServe v2 statistics), with the stage timings the
        runtime measured and its cache hits."""
        timeout = self.config.limits.request_timeout_s
        start = time.perf_counter_ns()
        deadline = time.monotonic() + timeout
        try:
            if _accepts_deadline(service):
                result = await invoke(deadline)
            else:
                try:
                    async with asyncio.timeout(timeout):
                        result = await invoke(deadline if _takes_deadline(service) else None)
                except TimeoutError:
                    raise DeadlineExceeded(f"request did not finish within {timeout:g} s") from None
        except Exception:
            self.stats.record_failure(service.name, service.version, time.perf_counter_ns() - start)
            raise
        elapsed = time.perf_counter_ns() - start
        delivery = awaited()
        if delivery is not None:  # the protocol awaits the answer's delivery: counted once it is delivered
            delivery.record(self.record, service, result, elapsed)
        else:
            # Counted right after this task's step, in which the caller writes the response: this
            # process's next request still sees it counted, and a lone request does not wait for it.
            asyncio.get_running_loop().call_soon(self.record, service, result, elapsed)
        return result

    async def _embed(self, service, texts, token_ids, options, deadline: float | None = None):
        def call(s):
            if deadline is not None and _accepts_deadline(s):
                return s.embed(texts=texts, token_ids=token_ids, options=options, deadline=deadline)
            return s.embed(texts=texts, token_ids=token_ids, options=options)

        return await self.on_current(service, call)

    def _current(self, s):
        try:
            return self.registry.get(s.name, s.version)
        except SurgeError:
            return s

    async def on_current(self, service, call):
        """`await call(copy)` on the copy of `service` that serves now. The copy a request looked up may have
        been replaced (a reload) between the lookup and the call, e.g. while the request body was still
        arriving: the new copy answers. Asked before the call (no await between this check and the call's
        admission), so that the retired copy does not count a request and a not_ready failure its client
        never saw; and again where the call itself says NotReady (a remote copy), which it raises before
        admitting any work, so the call is safe to repeat."""
        if not service.ready:
            service = self._current(service)
        try:
            return await call(service)
        except NotReady:
            now = self._current(service)
            if now is service:
                raise
            return await call(now)

    def cached(self, service, texts: list[str]) -> EmbedResult | None:
        """The fast path's cache lookup (default options), counted like `run` when it answers."""
        lookup = getattr(service, "cached_result", None)  # remote models (Ray ingress) have no local cache
        if lookup is None:
            return None
        start = time.perf_counter_ns()
        result = lookup(texts)
        if result is not None:
            self.record_answered(service, result, time.perf_counter_ns() - start)
        return result

    def record_answered(self, service, result: EmbedResult, elapsed_ns: int) -> None:
        """`record` a request answered without `call` (a hot path's cache hit): once its answer is delivered where
        the protocol awaits that (runtime/outcome.awaited), else now. A lost answer counts "cancelled" on /metrics
        (runtime/outcome.answered), neither a success nor the model's failure here."""
        delivery = awaited()
        if delivery is None:
            self.record(service, result, elapsed_ns)
        else:
            delivery.record(self.record, service, result, elapsed_ns)

    def record(self, service, result: EmbedResult, elapsed_ns: int) -> None:
        """Count one answered request in the KServe statistics (every protocol, one place)."""
        self.stats.record_success(service.name, service.version, result, elapsed_ns,
                                  cache_enabled=bool(getattr(getattr(service, "cache_cfg", None), "enabled", False)))


async def _checked(embedding, check):
    """`await embedding`, then `await check(result)`, the runtime's count of the request answered held until the
    check has passed: by the delivery the caller awaits (every HTTP POST, server/http/delivery.py), else by a
    Delivery of its own. Where the check refuses the answer, that delivery settles with the refusal's code, so the
    request counts its refusal's failure only (before, the runtime had counted it answered, its latency observed,
    and the refusal counted a failure too)."""
    d = awaited()
    own = d is None
    if own:
        d = Delivery()
        token = awaiting(d)
        try:
            result = await embedding
        except BaseException:
            d.settle(None)  # not answered: the runtime counted its failure, nothing waits here
            raise
        finally:
            stop_awaiting(token)
    else:
        result = await embedding
    try:
        await check(result)
    except SurgeError as exc:
        d.settle(exc.code)
        raise
    except Exception:
        d.settle("internal_error")
        raise
    except BaseException:
        if own:  # the caller's delivery is the caller's to settle (its connection lost: "cancelled")
            d.settle(CANCELLED)
        raise
    if own:
        d.settle(None)
    return result


def _inner(service):
    """The local service behind the repository's ServedModel and a multi-head model's HeadView."""
    for _ in range(3):
        inner = getattr(service, "__dict__", {}).get("service")
        if inner is None:
            return service
        service = inner
    return service


def _accepts_deadline(service) -> bool:
    """A local embedding model's embed: it enforces the deadline itself."""
    return isinstance(_inner(service), ModelService) and getattr(service, "task", "embed") == "embed"


def _takes_deadline(service) -> bool:
    """A local model (embedding, task heads, tensor): its batcher drops the call at the deadline."""
    from surge.runtime.tensor_service import TensorModelService

    return isinstance(_inner(service), (ModelService, TensorModelService))
