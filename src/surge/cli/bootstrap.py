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
from surge.models.decoder import is_decoder_dir
from surge.models.hf import ModelSpec
from surge.runtime.registry import ModelRegistry
from surge.server.state import AppState

log = logging.getLogger("surge")


def resolve_artifact(spec: ModelSpec, engine: EngineConfig, cache_dir: Path | None, backbone: bool = False
                     ) -> Path | None:
    """The artifact an engine loads; exported once (with progress) and cached. A task model's graph
    keeps its head (logits out) unless `backbone`: several heads (model.yaml `heads:`) share it."""
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

        return ensure_exported(spec, cache_dir or default_cache_dir(), progress=progress, backbone=backbone)


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


def load_service(config: ServerConfig, spec: ModelSpec, version: str = "1", engine: EngineConfig | None = None,
                 *, artifact: Path | None = None, batching=None, cache=None, heads=None, generation=None):
    from surge.models.tasks import check_servable
    from surge.runtime.loader import build_worker
    from surge.runtime.service import ModelService

    engine = engine or config.engine
    if is_decoder_dir(spec.path):  # a causal LM: task "generate", served by its own service
        from surge.runtime.loader import build_generate_service

        return build_generate_service(spec, version, engine, config.limits, config.generation.merged(generation))
    # Before any export: a model surge cannot serve fails the start naming its architecture.
    check_servable(spec.task_info, spec.model_type, spec.path)
    artifact = artifact or resolve_artifact(spec, engine, config.cache_dir, backbone=bool(heads))
    batching = batching or config.batching
    worker = build_worker(spec, artifact, engine, heads=heads, batch_tokens=batching.max_batch_tokens)
    service = ModelService(spec.name, version, worker, batching=batching,
                           cache=cache or config.cache, limits=config.limits)
    if heads:  # multi-head model.yaml: every head under its own name as well
        from surge.runtime.tasks import HeadView

        service.views = [HeadView(service, worker.heads[h.name], h.name) for h in heads if h.name != spec.name]
        service.task = worker.heads[heads[0].name].task
    return service


def load_repository_version(config: ServerConfig, entry):
    """The repository's loader: one `models/<name>/<version>/model.yaml` -> a warmed-up ModelService."""
    from dataclasses import replace

    cfg = entry.config
    if cfg.kind != "hf":  # onnx, torch, python: a tensor model from its version directory
        from surge.runtime.tensor_loader import build_tensor_service, model_path

        own_cache = cfg.cache if cfg.kind == "python" else (cfg.cache or config.cache)
        return build_tensor_service(entry.name, entry.version, cfg.kind, model_path(entry.dir, cfg.kind, cfg.tensor),
                                    cfg.tensor, cfg.engine, cfg.batching or config.batching, own_cache, config.limits)
    # Exported under the model directory's own name, so every entry (and every
    # version) of one model shares one cached artifact; served under the entry's.
    source = load_model_spec(entry.source_dir or bundled_model_dir(), task=cfg.task)
    artifact = None if is_decoder_dir(source.path) else \
        entry.artifact_dir or _cached_artifact(source, cfg.engine, config.cache_dir, backbone=bool(cfg.heads))
    heads = [h.model_copy(update={"source": str(entry.resolve(h.source))}) if h.source else h
             for h in cfg.heads] if cfg.heads else None
    return load_service(config, replace(source, name=entry.name), entry.version, cfg.engine, artifact=artifact,
                        batching=cfg.batching, cache=cfg.cache, heads=heads, generation=cfg.generation)


_ARTIFACTS: dict[tuple, Path | None] = {}


def _cached_artifact(spec: ModelSpec, engine: EngineConfig, cache_dir: Path | None, backbone: bool = False
                     ) -> Path | None:
    """resolve_artifact, remembered while the model's files are unchanged: a reload
    then skips hashing the weights (a quarter of a second for MiniLM)."""
    files = tuple(sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in spec.path.rglob("*") if p.is_file()))
    key = (str(spec.path), spec.task, backbone, engine.engine, str(cache_dir), files)
    found = _ARTIFACTS.get(key)
    if found is None or not found.is_dir():
        found = _ARTIFACTS[key] = resolve_artifact(spec, engine, cache_dir, backbone=backbone)
    return found


def add_repository(state: AppState) -> None:
    """Repository mode: models and pipelines from --model-repository, lifecycle API on."""
    from surge.runtime.dag import PipelineSet
    from surge.runtime.repository import ModelRepository

    config = state.config
    from surge.runtime.tensor_loader import attach_registry

    def loader(entry):
        service = load_repository_version(config, entry)
        attach_registry(service, state.registry)  # a python model's in-process client
        return service

    repo = ModelRepository(config.model_repository, state.registry, loader=loader,
                           poll_s=config.repository_poll_s)
    pipelines = PipelineSet(state.registry, root=repo.root)
    state.lifecycle = repo
    state.extras["repository"] = repo
    state.extras["pipelines"] = pipelines

    async def start(state: AppState) -> None:
        repo.model_names()  # a missing directory fails the start with a clear message
        await repo.start()
        for name, path in repo.pipeline_files().items():
            try:
                await pipelines.load(name, path)
            except Exception as exc:  # reported by GET /pipelines; the models keep serving
                log.error("pipeline %s: %s", name, getattr(exc, "message", exc))
        loaded = ", ".join(f"{s.name}:{s.version}" for s in state.registry.services()) or "nothing"
        print(f"surge: ready, serving {loaded} from {repo.root} on http://{config.host}:{config.port}",
              file=sys.stderr, flush=True)

    async def stop(state: AppState) -> None:
        await repo.close()

    state.extras.setdefault("on_startup", []).append(start)
    state.extras.setdefault("on_shutdown", []).append(stop)


def build_state(config: ServerConfig) -> AppState:
    state = AppState(config=config, registry=ModelRegistry())
    if config.model_repository is not None:
        add_repository(state)
    else:
        add_single_model(state)
    if config.grpc_port:
        from surge.server.grpc.server import install_grpc

        install_grpc(state)
    if _uses_gpu(config):
        from surge.engines.gpu_metrics import register_gpu_metrics
        from surge.runtime.metrics import default_registry

        # GPU utilization, SM utilization and occupancy (NVML) next to the runtime's metrics.
        register_gpu_metrics(default_registry())
    return state


def _uses_gpu(config: ServerConfig) -> bool:
    if config.engine.device.startswith("cuda") or config.engine.devices:
        return True
    return config.model_repository is not None  # a repository may place any model on a GPU


def add_single_model(state: AppState) -> None:
    """The bundled model (or --model-dir) alone; KServe's repository calls reload it."""
    from surge.cli.single_model import SingleModelLifecycle

    config = state.config

    async def load_single(state: AppState) -> None:
        model_dir = config.model_dir or bundled_model_dir()
        if _tensor_file(model_dir):  # surge serve model.onnx / model.pt2 / model.py
            from surge.runtime.tensor_loader import attach_registry

            service = await asyncio.to_thread(load_tensor_file, config, model_dir)
            attach_registry(service, state.registry)
            state.lifecycle = None
            state.registry.add(service)
            await service.warmup()
            service.mark_ready()
            print(f"surge: ready, serving {service.name} ({service.kind}) on http://{config.host}:{config.port}",
                  file=sys.stderr, flush=True)
            return
        spec = load_model_spec(model_dir, name=config.model_name, task=config.task)
        state.registry.set_aliases(spec.name, config.served_model_names)
        service = await asyncio.to_thread(load_service, config, spec)
        service.mark_ready()  # before it is added: registry listeners (gRPC health) see it ready
        state.registry.add(service)
        if config.cache.query_log is not None:
            # Fill the pinned tier from the query log in the background (low priority).
            state.extras.setdefault("background", set()).add(asyncio.create_task(service.prefill_pinned()))
        log.info("serving %s version %s", service.name, service.version)
        print(f"surge: ready, serving {service.name} on http://{config.host}:{config.port}", file=sys.stderr, flush=True)

    state.extras.setdefault("on_startup", []).append(load_single)
    state.lifecycle = SingleModelLifecycle(config, state.registry)


def _tensor_file(path: Path) -> bool:
    from surge.runtime.tensor_loader import kind_of_path

    return kind_of_path(path) is not None


def load_tensor_file(config: ServerConfig, path: Path):
    """`surge serve model.onnx` (or .pt2, or model.py): one tensor model, named after the file."""
    from surge.models.tensor_config import TensorModelOptions
    from surge.runtime.tensor_loader import build_tensor_service, kind_of_path

    path = Path(path).resolve()
    folder = path.parent.parent if path.parent.name.isdigit() else path.parent  # <name>/<version>/model.onnx
    name = config.model_name or (folder.name if path.stem == "model" else path.stem)
    # A model.yaml or config.pbtxt beside the file declares what the graph cannot (a python model's tensors).
    opts, engine, batching = TensorModelOptions(), config.engine, config.batching
    beside = next((p for p in (path.parent / "model.yaml", path.parent / "config.pbtxt") if p.is_file()), None)
    if beside is not None:
        from surge.config import ModelFile, load_yaml_file
        from surge.models.config_pbtxt import load_model_file

        mf = load_yaml_file(beside, ModelFile) if beside.suffix == ".yaml" else load_model_file(beside)
        opts, batching = mf.tensor, mf.batching or batching
        if "engine" in mf.model_fields_set:
            engine = mf.engine
    return build_tensor_service(name, "1", kind_of_path(path), path, opts, engine, batching, config.cache,
                                config.limits)
