"""A decoder's LoRA adapters as the server sees them: names, identities, model views.

An adapter is served under its own model name (vLLM's way: `"model": "NAME"` in a request) by an
`AdapterView` of the base model's GenerateService, registered beside it; every route that takes a
generate model takes the view unchanged, and the view's requests run on the base model's engine,
whose loop gives the adapter an engine slot when they are admitted (runtime/scheduler/adapters.py).
An adapter's identity is a digest of its files: it keys the generation cache (also the shared Redis
tier, across processes) and, as an integer, the prefix cache's hash chain, so neither serves one
adapter's work to another or to an adapter reloaded with new weights.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from surge.errors import ConfigError


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    digest: str  # sha256 of adapter_config.json and adapter_model.safetensors

    @property
    def uid(self) -> int:
        """The prefix cache's key of the adapter: the same in every process (front ends share an engine)."""
        return int(self.digest[:15], 16) or 1

    def describe(self) -> dict:
        return {"name": self.name, "path": str(self.path), "digest": self.digest}


def digest_of(path: Path, shown: str | None = None, adapter: str | None = None) -> str:
    """`shown`: the directory as messages name it (the path a client gave); only regular files are read."""
    from surge.models.lora import open_regular

    h = hashlib.sha256()
    shown = shown if shown is not None else str(path)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open_regular(path / name, os.path.join(shown, name), adapter or path.name) as fh:
            try:
                h.update(hashlib.file_digest(fh, "sha256").digest())
            except OSError as exc:
                raise ConfigError(f"LoRA adapter at {shown}: cannot read {name} ({exc.strerror or exc})") from None
    return h.hexdigest()


class AdapterView:
    """The base model's service answering as one of its adapters: `stream` / `generate` run with the
    adapter; everything else (tokenizer, chat template, limits, metrics, readiness) is the base's."""

    views = ()  # registered on its own (Registry.add would otherwise register the base's adapters again)

    def __init__(self, base, adapter: Adapter):
        self.base = base
        self.adapter = adapter
        self.name = adapter.name
        self.parent = base.name

    def __getattr__(self, attr):
        return getattr(self.base, attr)

    @property
    def version(self) -> str:
        return self.base.version

    @property
    def ready(self) -> bool:
        return self.base.ready and self.base.adapters.get(self.name) is self.adapter

    def kserve_metadata(self, versions: list[str]) -> dict:
        return {**self.base.kserve_metadata(versions), "name": self.name}

    async def close(self) -> None:
        """Nothing of its own to close: the base model's service closes the engine."""

    async def generate(self, prompt_ids, params, **kw):
        return await self.base.generate(prompt_ids, params, adapter=self.name, **kw)

    def stream(self, prompt_ids, params, **kw):
        return self.base.stream(prompt_ids, params, adapter=self.name, **kw)
