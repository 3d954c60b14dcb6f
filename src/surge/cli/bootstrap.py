"""Wiring a ServerConfig into an AppState: what to load and how to export it.

This lives in cli/ because it is the one place allowed to reach both the
offline side (optimize/export) and the online side (runtime, server).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from surge.config import EngineConfig, ServerConfig, default_cache_dir
from surge.models import bundled_model_dir, load_model_spec
from surge.models.decoder import is_decoder_dir, is_decoder_encoder_dir
from surge.models.hf import ModelSpec
from surge.runtime.registry import ModelRegistry
from surge.server.state import AppState

log = logging.getLogger("surge")


def resolve_artifact(spec: ModelSpec, engine: EngineConfig, cache_dir: Path | None, backbone: bool = False
                     ) -> Path | None:
    """The artifact an engine loads; exported once (with progress) and cached. A task model's graph
    keeps its head (logits out) unless `backbone`: several heads (model.yaml `heads:`) share it."""
    if engine.engine != "onnxrt" or is_decoder_encoder_dir(spec.path):
        return None  # the torch engine and the decoder embedder load the weights directly
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
    if is_decoder_dir(spec.path) and spec.task == "generate":  # a causal LM, served by its own service
        from surge.runtime.loader import build_generate_service

        from surge.runtime.generate_service import attach_shared_cache

        service = build_generate_service(spec, version, engine, config.limits, config.generation.merged(generation))
        attach_shared_cache(service, cache or config.cache)
        return service
    # Before any export: a model surge cannot serve fails the start naming its architecture.
    check_servable(spec.task_info, spec.model_type, spec.path)
    artifact = artifact or resolve_artifact(spec, engine, config.cache_dir, backbone=bool(heads))
    engine = _artifact_layout(engine, artifact)
    batching = _artifact_batch_cap(batching or config.batching, artifact)
    worker = build_worker(spec, artifact, engine, heads=heads, batch_tokens=batching.max_batch_tokens)
    service = ModelService(spec.name, version, worker, batching=batching,
                           cache=cache or config.cache, limits=config.limits)
    if heads:  # multi-head model.yaml: every head under its own name as well
        from surge.runtime.tasks import HeadView

        service.views = [HeadView(service, worker.heads[h.name], h.name) for h in heads if h.name != spec.name]
        service.task = worker.heads[heads[0].name].task
    return service


def _artifact_batch_cap(batching, artifact: Path | None):
    """The batcher settings with the artifact's measured serving batch size (optimize/serving_batch.py) as the
    cap, when nothing the user set (a flag, a SURGE_* variable, a model.yaml) names one."""
    from surge.optimize.serving_batch import serving_hint

    hint = serving_hint(artifact)
    if hint is None or "max_batch_size" in batching.model_fields_set:
        return batching
    print(f"surge: batches capped at {hint}, the serving batch size measured by `surge optimize` for {artifact} "
          "(--max-batch-size overrides)", file=sys.stderr, flush=True)
    return batching.model_copy(update={"max_batch_size": hint})


def _artifact_layout(engine: EngineConfig, artifact: Path | None) -> EngineConfig:
    """The engine settings with the artifact's measured layout (optimize/serving_layout.py: intra-op threads and
    instances), when nothing the user set (--threads, --instances, their SURGE_* variables, a model.yaml's engine
    section) names either and this machine has the usable cores it was measured on."""
    from surge.optimize.serving_layout import layout_hint, usable_cores

    hint = layout_hint(artifact)
    if hint is None or engine.engine != "onnxrt" or {"threads", "instances"} & engine.model_fields_set:
        return engine
    here = usable_cores()
    if hint["cores"] != here:  # the layout of another core count says nothing of this one
        print(f"surge: the engine layout `surge optimize` measured for {artifact} is for {hint['cores']} cores, this "
              f"process has {here}: not applied (--threads / --instances set one)", file=sys.stderr, flush=True)
        return engine
    print(f"surge: {hint['instances']} engine instance(s) x {hint['threads']} thread(s), the serving layout measured "
          f"by `surge optimize` for {artifact} (--threads / --instances override)", file=sys.stderr, flush=True)
    return engine.model_copy(update={"threads": hint["threads"], "instances": hint["instances"]})


def load_repository_version(config: ServerConfig, entry, *, single: bool = False):
    """The one builder: one entry's `model.yaml` (a repository's version, or the one model of
    `surge serve MODEL`) -> a ModelService (engines built and warmed up; ModelRepository then
    warms it up through the full path). The server's sections (flags, SURGE_* variables) and
    the model.yaml's are merged field by field (`_sections`)."""
    from dataclasses import replace

    cfg = entry.config
    engine, batching, cache, generation = _sections(config, cfg, single)
    generation = _own_draft(generation, entry)
    if cfg.kind != "hf":  # onnx, torch, python: a tensor model from its version directory
        from surge.runtime.tensor_loader import build_tensor_service, model_path

        # A python model may answer differently each call: cached only when its model.yaml asks.
        own_cache = (cache if cfg.cache is not None else None) if cfg.kind == "python" else cache
        return build_tensor_service(entry.name, entry.version, cfg.kind, model_path(entry.dir, cfg.kind, cfg.tensor),
                                    cfg.tensor, engine, batching, own_cache, config.limits)
    # Exported under the model directory's own name, so every entry (and every
    # version) of one model shares one cached artifact; served under the entry's.
    source = load_model_spec(entry.source_dir or bundled_model_dir(), task=cfg.task)
    artifact = None if is_decoder_dir(source.path) or is_decoder_encoder_dir(source.path) else \
        entry.artifact_dir or _cached_artifact(source, engine, config.cache_dir, backbone=bool(cfg.heads))
    heads = [h.model_copy(update={"source": str(entry.resolve(h.source))}) if h.source else h
             for h in cfg.heads] if cfg.heads else None
    return load_service(config, replace(source, name=entry.name), entry.version, engine, artifact=artifact,
                        batching=batching, cache=cache, heads=heads, generation=generation)


def decoder_settings(config: ServerConfig, entry):
    """(ModelSpec under the entry's name, engine settings, generation settings) of a repository entry
    that is a decoder model, else None (what load_repository_version would build it with)."""
    from dataclasses import replace

    cfg = entry.config
    if cfg is None or cfg.kind != "hf":
        return None
    source = load_model_spec(entry.source_dir or bundled_model_dir(), task=cfg.task)
    if not is_decoder_dir(source.path):
        return None
    engine, _, _, generation = _sections(config, cfg, False)
    return replace(source, name=entry.name), engine, config.generation.merged(_own_draft(generation, entry))


def _own_draft(generation, entry):
    """A model.yaml's draft model (generation.speculative_model) is relative to its version directory, as
    `source` is; the server's own setting (flags, variables) stays as given."""
    draft = entry.speculative_model_dir
    if generation is None or draft is None or generation.speculative_model != entry.config.generation.speculative_model:
        return generation
    return generation.model_copy(update={"speculative_model": str(draft)})


def _sections(config: ServerConfig, cfg, single: bool):
    """Engine, batching, cache and generation settings of one model, merged field by field.

    The more specific source wins. In a repository the server's settings are every model's
    defaults and a model.yaml's fields override them. `surge serve MODEL`'s flags and
    variables are about that one model: the fields they set override its model.yaml's
    (flag > SURGE_* variable > model.yaml > field default)."""
    from surge.config import merge_set

    def pick(server, own):
        if own is None:
            return server
        return merge_set(own, server) if single else merge_set(server, own)

    engine_own = cfg.engine if "engine" in cfg.model_fields_set else None
    return (pick(config.engine, engine_own), pick(config.batching, cfg.batching), pick(config.cache, cfg.cache),
            pick(config.generation, cfg.generation))


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


def add_lifecycle(state: AppState) -> None:
    """One lifecycle for both modes: a ModelRepository over the repository directory
    (--model-repository, pipelines too) or over the one entry of `surge serve MODEL`.
    Load, warm-up, ready, reload, unload, the KServe repository index, and the drain on
    SIGTERM are that class's, whichever the mode."""
    from surge.runtime.repository import DiskCatalog, ModelRepository
    from surge.runtime.tensor_loader import attach_registry

    config = state.config
    single = config.model_repository is None
    if single:
        from surge.cli.single_model import SingleModelCatalog

        catalog = SingleModelCatalog(config)
    else:
        catalog = DiskCatalog(config.model_repository)

    def loader(entry):
        service = load_repository_version(config, entry, single=single)
        attach_registry(service, state.registry)  # a python model's in-process client
        return service

    repo = ModelRepository(catalog, state.registry, loader=loader, reload_on_load=single,
                           poll_s=None if single else config.repository_poll_s)
    state.lifecycle = repo
    state.extras["repository"] = repo
    pipelines = None
    if not single:
        from surge.runtime.dag import PipelineSet

        pipelines = state.extras["pipelines"] = PipelineSet(state.registry, root=repo.root)

    async def start(state: AppState) -> None:
        repo.model_names()  # a missing directory fails the start with a clear message
        await repo.start(strict=single)  # the one model failing to load fails the start
        for name, path in repo.pipeline_files().items():
            try:
                await pipelines.load(name, path)
            except Exception as exc:  # reported by GET /pipelines; the models keep serving
                log.error("pipeline %s: %s", name, getattr(exc, "message", exc))
        loaded = ", ".join(s.name if single else f"{s.name}:{s.version}" for s in state.registry.services())
        where = "" if single else f" from {repo.root}"
        print(f"surge: ready, serving {loaded or 'nothing'}{where} on http://{config.host}:{config.port}",
              file=sys.stderr, flush=True)

    async def stop(state: AppState) -> None:
        await repo.close()  # routing stops, in-flight calls finish, every version is freed

    state.extras.setdefault("on_startup", []).append(start)
    state.extras.setdefault("on_shutdown", []).append(stop)


def build_state(config: ServerConfig) -> AppState:
    state = AppState(config=config, registry=ModelRegistry())
    if config.grpc_port:
        from surge.server.grpc.server import install_grpc

        install_grpc(state)
    # After gRPC: on SIGTERM the gRPC server stops taking calls (finishing those in flight)
    # before the models drain.
    add_lifecycle(state)
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
