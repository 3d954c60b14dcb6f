"""ModelLifecycle for `surge serve MODEL_DIR` (one model, version "1").

What the KServe repository extension (load, unload, index) does when there is
no model repository: unload takes the model out of the registry and frees it
(later requests get 404 / NOT_FOUND), load builds it again from the same
configuration and registers it once it is warmed up; load of a loaded model
reloads it (the new copy is registered before the old one is drained and
freed, so requests keep being answered; one that still reaches the old copy
is handed to the new one by AppState.run).
"""

from __future__ import annotations

import asyncio
import logging
from functools import cached_property

from surge.config import ServerConfig
from surge.errors import EngineError, NotFound, SurgeError, shown
from surge.models import bundled_model_dir, load_model_spec
from surge.runtime.registry import ModelRegistry

log = logging.getLogger("surge")
VERSION = "1"
DRAIN_GRACE_S = 0.2  # as ModelRepository.drain_grace_s


class SingleModelLifecycle:
    def __init__(self, config: ServerConfig, registry: ModelRegistry):
        self.config = config
        self.registry = registry
        self._lock = asyncio.Lock()
        self._loading = False
        self._reason = ""

    @cached_property
    def spec(self):
        return load_model_spec(self.config.model_dir or bundled_model_dir(), name=self.config.model_name)

    @property
    def name(self) -> str:
        return self.spec.name

    def _check(self, name: str, version: str | None) -> None:
        if name != self.name:
            raise NotFound(f"model '{shown(name)}' not found; this server serves '{self.name}'", param="model")
        if version not in (None, "", VERSION):
            raise NotFound(f"model '{shown(name)}' has no version '{shown(version)}'", param="version")

    def _loaded(self):
        try:
            return self.registry.get(self.name, VERSION)
        except NotFound:
            return None

    async def index(self) -> list[dict]:
        service = self._loaded()
        if self._loading:
            state = "LOADING"
        elif service is not None and service.ready:
            state = "READY"
        else:
            state = "UNAVAILABLE"
        return [{"name": self.name, "version": VERSION, "state": state, "reason": self._reason}]

    async def load(self, name: str, version: str | None = None) -> None:
        self._check(name, version)
        from surge.cli.bootstrap import load_service

        async with self._lock:
            self._loading = True
            try:
                service = await asyncio.to_thread(load_service, self.config, self.spec, VERSION)
            except SurgeError as exc:
                self._reason = exc.message
                raise
            except Exception as exc:  # the model being served (if any) stays as it is
                self._reason = f"{type(exc).__name__}: {exc}"
                raise EngineError(f"loading model '{name}' failed: {self._reason}") from exc
            finally:
                self._loading = False
            old = self._loaded()
            service.mark_ready()
            self.registry.add(service)  # replaces the old copy, if any, for new requests
            self._reason = ""
            log.info("loaded %s version %s", service.name, service.version)
            if old is not None:
                # Drain as repository mode does: requests that looked the old copy up a
                # moment ago still reach it (a grace period), admitted work finishes
                # (close() waits for it), then it is freed.
                await asyncio.sleep(DRAIN_GRACE_S)
                await old.close()

    async def unload(self, name: str, version: str | None = None) -> None:
        self._check(name, version)
        async with self._lock:
            service = self.registry.remove(self.name, VERSION)
            self._reason = "unloaded"
            if service is not None:
                await service.close()
                log.info("unloaded %s version %s", service.name, service.version)
