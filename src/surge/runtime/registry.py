"""Served models by name and version; the protocol layers look models up here."""

from __future__ import annotations

from surge.errors import NotFound, shown
from surge.runtime.service import ModelService


class ModelRegistry:
    def __init__(self, default: str | None = None):
        self._models: dict[str, dict[str, ModelService]] = {}
        self.default = default

    def add(self, service: ModelService) -> None:
        self._models.setdefault(service.name, {})[service.version] = service
        if self.default is None:
            self.default = service.name

    def remove(self, name: str, version: str) -> ModelService | None:
        versions = self._models.get(name, {})
        svc = versions.pop(version, None)
        if not versions:
            self._models.pop(name, None)
        return svc

    def names(self) -> list[str]:
        return sorted(self._models)

    def versions(self, name: str) -> list[str]:
        return sorted(self._models.get(name, {}), key=_version_key)

    def services(self) -> list[ModelService]:
        return [s for n in self.names() for s in (self._models[n][v] for v in self.versions(n))]

    def get(self, name: str | None = None, version: str | None = None) -> ModelService:
        name = name or self.default
        versions = self._models.get(name or "")
        if not versions:
            if name is None:
                raise NotFound("no model is loaded", param="model")
            raise NotFound(f"model '{shown(name)}' not found; available: {shown(', '.join(self.names()) or 'none', 512)}", param="model")
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
