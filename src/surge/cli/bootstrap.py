"""Wiring a ServerConfig into an AppState: what to load and how to export it.

This lives in cli/ because it is the one place allowed to reach both the
offline side (optimize/export) and the online side (runtime, server).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from surge.config import EngineConfig, ServerConfig, default_cache_dir
from surge.models import bundled_model_dir, load_model_spec
from surge.models.hf import ModelSpec
from surge.runtime.registry import ModelRegistry
from surge.server.state import AppState

log = logging.getLogger("surge")


def resolve_artifact(spec: ModelSpec, engine: EngineConfig, cache_dir: Path | None) -> Path | None:
    """The artifact an engine loads; exported once (with progress) and cached."""
    if engine.engine != "onnxrt":
        return None  # the torch engine loads the weights directly
    if is_artifact_dir(spec.path):
        return spec.path  # an artifact written by `surge optimize`: served as it is
    from rich.console import Console

    from surge.optimize.export import ensure_exported

    console = Console(stderr=True)
    with console.status(f"[bold]preparing {spec.name}[/]") as status:
        def progress(step: str) -> None:
            status.update(f"[bold]exporting {spec.name}[/]: {step}")
            if not console.is_terminal:
                print(f"surge: exporting {spec.name}: {step}", file=sys.stderr, flush=True)

        return ensure_exported(spec, cache_dir or default_cache_dir(), progress=progress)


def is_artifact_dir(path: Path) -> bool:
    """A directory `surge optimize` wrote: manifest.json + the model file, tokenizer alongside."""
    import json

    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    return (Path(path) / data.get("model_file", "model.onnx")).is_file()


def load_service(config: ServerConfig, spec: ModelSpec, version: str = "1", engine: EngineConfig | None = None):
    from surge.runtime.loader import build_worker
    from surge.runtime.service import ModelService

    engine = engine or config.engine
    artifact = resolve_artifact(spec, engine, config.cache_dir)
    worker = build_worker(spec, artifact, engine)
    return ModelService(spec.name, version, worker, batching=config.batching, cache=config.cache,
                        limits=config.limits)


def build_state(config: ServerConfig) -> AppState:
    state = AppState(config=config, registry=ModelRegistry())

    async def load_single(state: AppState) -> None:
        model_dir = config.model_dir or bundled_model_dir()
        spec = load_model_spec(model_dir, name=config.model_name)
        service = await asyncio.to_thread(load_service, config, spec)
        state.registry.add(service)
        service.mark_ready()
        log.info("serving %s version %s", service.name, service.version)
        print(f"surge: ready, serving {service.name} on http://{config.host}:{config.port}", file=sys.stderr, flush=True)

    state.extras.setdefault("on_startup", []).append(load_single)
    return state
