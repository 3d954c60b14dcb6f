"""Served models by name and version; the protocol layers look models up here."""

from __future__ import annotations

import logging
from typing import Callable

from surge.errors import ConfigError, NotFound, NotReady, shown
from surge.runtime.service import ModelService

log = logging.getLogger("surge")


class ModelRegistry:
    def __init__(self, default: str | None = None):
        self._models: dict[str, dict[str, ModelService]] = {}
        self._aliases: dict[str, str] = {}  # alias -> model name (kept while the model is unloaded)
        self._listeners: list[Callable[[], None]] = []
        self.default = default
        # the server is still loading its models (set by the app around startup): a model not found yet
        # may be on its way, so the answer is 503 (retry), not 404
        self.loading = False

    def add(self, service: ModelService) -> None:
        if self._aliases.get(service.name, service.name) != service.name:
            # A model's own name wins over another model's alias.
            log.warning("model '%s' is loaded: it is no longer an alias of '%s'", service.name,
                        self._aliases.pop(service.name))
        self._models.setdefault(service.name, {})[service.version] = service
        routed = getattr(service, "on_routed", None)
        if routed is not None:  # it takes this name and version's traffic: its metrics are the live ones
            routed()
        for view in getattr(service, "views", None) or ():  # heads of a multi-head model, by their names
            self._models.setdefault(view.name, {})[view.version] = view
        if self.default is None:
            self.default = service.name
        self._changed()

    def remove(self, name: str, version: str) -> ModelService | None:
        versions = self._models.get(name, {})
        svc = versions.pop(version, None)
        if not versions:
            self._models.pop(name, None)
        for view in getattr(svc, "views", None) or ():
            if view.name != name:
                self.remove(view.name, version)
        self._changed()
        return svc

    # ---- aliases: more names one model answers to (--served-model-name, model.yaml `aliases`)
    def set_aliases(self, name: str, aliases: list[str]) -> None:
        """Make `aliases` (and only them) answer for model `name`; ConfigError on a clash."""
        wanted = [a for a in dict.fromkeys(aliases) if a != name]
        for alias in wanted:
            if not alias or alias != alias.strip():
                raise ConfigError(f"model '{name}': alias {alias!r} is empty or has surrounding spaces")
            if alias in self._models:
                raise ConfigError(f"model '{name}': alias '{alias}' is the name of another model")
            owner = self._aliases.get(alias)
            if owner is not None and owner != name:
                raise ConfigError(f"model '{name}': alias '{alias}' already names model '{owner}'")
        self._aliases = {a: n for a, n in self._aliases.items() if n != name}
        self._aliases.update({a: name for a in wanted})
        self._changed()

    def aliases(self) -> dict[str, str]:
        """alias -> model name, for every alias (whether its model is loaded or not)."""
        return dict(self._aliases)

    def resolve(self, name: str | None) -> str | None:
        """The model name behind `name` (itself when it is no alias)."""
        if name is None or name in self._models:
            return name
        return self._aliases.get(name, name)

    # ---- change notification (gRPC health Watch follows it) ------------------------
    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def readiness_changed(self) -> None:
        """A served model's readiness changed on its own (a python model's workers went down or came back):
        the listeners re-read it. Call on the event loop."""
        self._changed()

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener()

    def names(self) -> list[str]:
        return sorted(self._models)

    def versions(self, name: str) -> list[str]:
        return sorted(self._models.get(self.resolve(name), {}), key=_version_key)

    def services(self) -> list[ModelService]:
        """Every served model (head views of a multi-head model included; see `backbones`)."""
        return [s for n in self.names() for s in (self._models[n][v] for v in self.versions(n))]

    def get(self, name: str | None = None, version: str | None = None) -> ModelService:
        asked = name or self.default
        name = self.resolve(asked)
        versions = self._models.get(name or "")
        if not versions:
            if self.loading:
                raise NotReady(f"model '{shown(asked or 'default')}' is not loaded yet: the server is starting",
                               retry_after=1)
            if name is None:
                raise NotFound("no model is loaded", param="model")
            if name != asked:
                raise NotFound(f"model '{shown(asked)}' (an alias of '{name}') is not loaded", param="model")
            # aliases of unloaded models answer 404 too: only names that would answer are offered
            known = ", ".join(self.names() + sorted(a for a, n in self._aliases.items() if self._models.get(n)))
            known = known or "none"
            raise NotFound(f"model '{shown(name)}' not found; available: {shown(known, 512)}", param="model")
        if version is None:
            return versions[self.versions(name)[-1]]
        svc = versions.get(str(version))
        if svc is None:
            raise NotFound(f"model '{shown(name)}' has no version '{shown(version)}'", param="version")
        return svc

    @property
    def ready(self) -> bool:
        services = self.services()
        return bool(services) and all(s.ready for s in services)


def _version_key(v: str):
    return (0, int(v), "") if v.isdigit() else (1, 0, v)
