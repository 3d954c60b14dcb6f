"""The HTTP face of surge on Ray Serve: surge's own FastAPI app (server/app.py,
every router, one error mapping) over a registry whose services are Ray
deployment handles with the same `embed()` coroutine as a ModelService.

Each response says which replica computed it (`x-surge-replica`) and how many of
its inputs came from the cache (`x-surge-cache-hits: hits/inputs`).
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from surge.config import ServerConfig
from surge.distributed.metrics_hub import collect_replicas
from surge.errors import EngineError, NotReady, Overloaded, SurgeError
from surge.runtime.registry import ModelRegistry
from surge.server.state import AppState
from surge.types import EmbedOptions, EmbedResult

log = logging.getLogger("surge.distributed")

REPLICA_HEADER = "x-surge-replica"
CACHE_HEADER = "x-surge-cache-hits"

# Per request: the replicas that answered and the cache flags of their answers.
# The middleware puts a fresh list here; RemoteModel.embed appends to it (tasks
# that wait_for creates copy the context, so they share the same list).
_served: ContextVar[list | None] = ContextVar("surge_served", default=None)

# A replica lost mid-request (its process died, or Ray is replacing it).
_LOST = (RayActorError, ReplicaUnavailableError)


class RemoteWorker:
    """What protocol layers read of a ModelWorker (e.g. KServe's model metadata
    reads engines.capabilities.device); the real one lives in the replicas."""

    def __init__(self, capabilities):
        self.engines = self
        self.capabilities = capabilities


class RemoteModel:
    """Stands in for a ModelService in the registry; the work runs on a replica."""

    def __init__(self, name: str, version: str, handle, retries: int = 1):
        self.name = name
        self.version = version
        self.handle = handle
        self.retries = retries
        self.ready = False
        self.loaded_at = time.time()
        self.dimensions = 0
        self.max_length = 0
        self.worker: RemoteWorker | None = None

    async def connect(self) -> None:
        """Learn the model's shape from a replica (waits until one is up)."""
        info = await self.handle.info.remote()
        self.dimensions = info["dimensions"]
        self.max_length = info["max_length"]
        self.loaded_at = info["loaded_at"]
        self.worker = RemoteWorker(info["capabilities"])
        self.ready = True

    def mark_ready(self) -> None:
        self.ready = True

    async def embed(self, texts: list[str] | None = None, token_ids: list[list[int]] | None = None,
                    options: EmbedOptions | None = None) -> EmbedResult:
        for attempt in range(self.retries + 1):
            try:
                result, replica = await self.handle.embed.remote(texts, token_ids, options)
            except _LOST as exc:
                # Ray's router has now dropped that replica: the retry goes to another.
                if attempt < self.retries:
                    log.warning("model %s: replica lost mid-request (%s); retrying", self.name, type(exc).__name__)
                    continue
                raise ray_error(self.name, exc) from None
            except (RayTaskError, BackPressureError, DeploymentUnavailableError) as exc:
                raise ray_error(self.name, exc) from None
            served = _served.get()
            if served is not None:
                served.append((replica, result.cached))
            return result
        raise AssertionError("unreachable")

    async def close(self) -> None:
        self.ready = False


def ray_error(name: str, exc: Exception) -> Exception:
    """What a client is told of Ray's failure of a call to model `name`'s replicas: the replica's own
    SurgeError, 429 where every replica's queue is full, 503 where the replica was lost or the deployment has
    no replica to take it (being deployed, scaled from zero, unhealthy: it was a bare 500); anything else as
    it is."""
    if isinstance(exc, RayTaskError):
        return _as_surge_error(exc)
    if isinstance(exc, BackPressureError):
        return Overloaded(f"model {name}: every replica's queue is full", retry_after=1)
    if isinstance(exc, _LOST):
        return NotReady(f"model {name}: replica lost mid-request; try again", retry_after=1)
    if isinstance(exc, DeploymentUnavailableError):
        return NotReady(f"model {name}: no replica is available now; try again", retry_after=1)
    return exc


def _as_surge_error(exc: RayTaskError) -> SurgeError:
    """The SurgeError raised in the replica (pickled with its fields), or an engine error."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, SurgeError):
        return cause
    log.error("replica failed: %s", exc)
    return EngineError(f"replica failed: {type(cause).__name__ if cause else 'error'}")


class ServedByMiddleware:
    """Adds the replica and cache headers (pure ASGI: cheap on the hot path)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        served: list = []
        token = _served.set(served)

        async def send_with_headers(message):
            if message["type"] == "http.response.start" and served:
                replicas = ",".join(dict.fromkeys(r for r, _ in served))
                flags = [bool(c) for _, cached in served for c in cached]
                headers = list(message.get("headers", []))
                headers.append((REPLICA_HEADER.encode(), replicas.encode()))
                headers.append((CACHE_HEADER.encode(), f"{sum(flags)}/{len(flags)}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _served.reset(token)


class SurgeIngress:
    """The ingress deployment's body: builds surge's app once its handles exist."""

    def __init__(self, config: ServerConfig, models: list[tuple[str, str, object]], retries: dict[str, int]):
        registry = ModelRegistry()
        from surge.distributed.remote_generate import RemoteGenerateModel

        # (name, version, handle[, task]): a decoder model's stand-in has generate() and stream()
        self.remotes = [(RemoteGenerateModel if task == ["generate"] else RemoteModel)(
                            name, version, handle, retries.get(f"{name}:{version}", 1))
                        for name, version, handle, *task in models]
        for remote in self.remotes:
            registry.add(remote)  # duck-typed: same attributes and embed() as a ModelService
        if config.model_repository is None and self.remotes:  # --served-model-name for the one model
            registry.set_aliases(self.remotes[0].name, config.served_model_names)
        self.state = AppState(config=config, registry=registry)
        self.state.extras["on_startup"] = [self._connect]
        # /metrics also shows every model replica's metrics (distributed/metrics_hub.py).
        self.state.extras["metrics_sources"] = collect_replicas
        # The ingress must not stop its own process when startup fails; it reports it.
        self.state.extras["exit_on_startup_failure"] = False

    async def _connect(self, state: AppState) -> None:
        for remote in self.remotes:
            await remote.connect()
            for view in getattr(remote, "views", ()):  # a decoder's LoRA adapters, by their names
                state.registry.add(view)
            log.info("ingress: routing %s v%s", remote.name, remote.version)

    def __serve_build_asgi_app__(self):
        from surge.server.app import create_app

        app = create_app(self.state)
        # Outermost, around the hot path too (server/http/hotpath.install_outer wraps the
        # middleware stack, so add_middleware would put these headers inside it and a plain
        # /embed, which the hot path answers, would go out without them).
        build = app.build_middleware_stack
        app.build_middleware_stack = lambda: ServedByMiddleware(build())
        return app
