"""Building a TensorModelService from a model file (kinds onnx, torch, python).

The contract (inputs, outputs, max_batch_size) comes from the graph for onnx
and torch, refined by the declarations of the model.yaml / config.pbtxt
(which must agree with the graph), and from the declarations alone for python.
"""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath

from surge.config import BatchingConfig, CacheConfig, EngineConfig, LimitsConfig
from surge.errors import ConfigError
from surge.models.tensor_config import (DEFAULT_FILES, TensorModelConfig, TensorModelOptions, TensorSpec,
                                        specs_from_decls)
from surge.runtime.tensor_service import StackedBackend, TensorModelService

log = logging.getLogger("surge.tensor")

KIND_OF_SUFFIX = {".onnx": "onnx", ".pt2": "torch", ".py": "python"}


def kind_of_path(path: Path) -> str | None:
    """`surge serve model.onnx` (or .pt2, or model.py): the tensor kind a file path names."""
    path = Path(path)
    if path.is_file():
        return KIND_OF_SUFFIX.get(path.suffix)
    return None


def model_path(version_dir: Path, kind: str, opts: TensorModelOptions) -> Path:
    name = opts.file or DEFAULT_FILES[kind]
    if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
        # A model.yaml reaches only its own version's files: not another model's, not the host's.
        raise ConfigError(f"{version_dir}: field 'tensor.file' must be a path inside the version directory "
                          "(not absolute, no '..')", param="tensor.file")
    path = version_dir / name
    if not path.is_file():
        raise ConfigError(f"{version_dir}: kind {kind} needs the model file {path.name} (field 'tensor.file')",
                          param="tensor.file")
    return path


def _merge(graph: list[tuple[str, str, tuple[int, ...]]], declared: list[TensorSpec] | None, batched: bool,
           what: str, where: str) -> list[TensorSpec]:
    """The graph's tensors, refined by the declaration (which may only name and narrow them)."""
    specs = [TensorSpec(n, dt, tuple(shape[1:] if batched else shape)) for n, dt, shape in graph]
    if declared is None:
        return specs
    by_name = {s.name: s for s in specs}
    out = []
    for d in declared:
        g = by_name.get(d.name)
        if g is None:
            raise ConfigError(f"{where}: field 'tensor.{what}': '{d.name}' is not an {what[:-1]} of the graph "
                              f"(graph: {', '.join(by_name)})", param=f"tensor.{what}")
        if d.datatype != g.datatype or len(d.dims) != len(g.dims) or any(
                gd != -1 and dd != gd for dd, gd in zip(d.dims, g.dims)):
            raise ConfigError(f"{where}: field 'tensor.{what}': '{d.name}' is declared {d.datatype} {list(d.dims)} "
                              f"but the graph has {g.datatype} {list(g.dims)}", param=f"tensor.{what}")
        out.append(TensorSpec(d.name, d.datatype, d.dims, d.optional))
    missing = [s.name for s in specs if s.name not in {d.name for d in declared}]
    if missing and what == "inputs":
        raise ConfigError(f"{where}: field 'tensor.inputs': the graph's input(s) {', '.join(missing)} are not "
                          "declared", param="tensor.inputs")
    return out


def _graph_batched(engine) -> bool:
    """A dynamic first dim on every input and output: the batcher may stack requests."""
    tensors = engine.inputs + engine.outputs
    return bool(tensors) and all(len(shape) >= 1 and shape[0] == -1 for _, _, shape in tensors)


def build_tensor_service(name: str, version: str, kind: str, path: Path, opts: TensorModelOptions,
                         engine_cfg: EngineConfig, batching: BatchingConfig, cache: CacheConfig | None,
                         limits: LimitsConfig | None) -> TensorModelService:
    where = str(path.parent)
    if kind == "python":
        return _python_service(name, version, path, opts, engine_cfg, batching, cache, limits)
    if kind == "onnx":
        from surge.engines.tensor_onnx import OnnxTensorEngine

        engine = OnnxTensorEngine(device=engine_cfg.device, threads=engine_cfg.threads)
    elif kind == "torch":
        from surge.engines.tensor_torch import TorchTensorEngine

        engine = TorchTensorEngine(device=engine_cfg.device, precision=engine_cfg.precision,
                                   output_names=[o.name for o in opts.outputs] if opts.outputs else None)
    else:
        raise ConfigError(f"unknown tensor model kind {kind!r}")
    engine.load(path)
    batched = _graph_batched(engine) and opts.max_batch_size != 0
    max_batch = (opts.max_batch_size or batching.max_batch_size) if batched else 0
    try:
        inputs = _merge(engine.inputs, specs_from_decls(opts.inputs), batched, "inputs", where)
        outputs = _merge(engine.outputs, specs_from_decls(opts.outputs), batched, "outputs", where)
    except ConfigError:
        engine.close()
        raise
    if kind == "torch":
        engine.warmup(max_batch if batched else 0)  # CUDA graphs per batch bucket on the GPU
    # ONNX Runtime's run is thread-safe: `instances` batches run on the one session at once (Triton's instance
    # count). A torch model's CUDA graphs replay from shared buffers, so its batches run one at a time.
    instances = engine_cfg.instances if kind == "onnx" else 1
    if kind == "torch" and engine_cfg.instances > 1:
        log.warning("%s: a torch model runs one batch at a time; instances %d is served as 1", where,
                    engine_cfg.instances)
    config = TensorModelConfig(name, kind, inputs, outputs, max_batch, engine_cfg.device, instances,
                               int(batching.max_queue_delay_ms * 1000), path.name, dict(opts.parameters))
    return TensorModelService(name, version, config, StackedBackend(engine, batched), batching=batching,
                              cache=cache, limits=limits)


def _python_service(name, version, path: Path, opts: TensorModelOptions, engine_cfg: EngineConfig,
                    batching: BatchingConfig, cache: CacheConfig | None, limits) -> TensorModelService:
    from surge.runtime.python_worker import PythonBackend

    inputs, outputs = specs_from_decls(opts.inputs), specs_from_decls(opts.outputs)
    if not inputs or not outputs:
        raise ConfigError(f"{path.parent}: kind python needs its inputs and outputs declared "
                          "(model.yaml 'tensor.inputs' / 'tensor.outputs', or config.pbtxt input / output)",
                          param="tensor.inputs")
    max_batch = batching.max_batch_size if opts.max_batch_size is None else opts.max_batch_size
    config = TensorModelConfig(name, "python", inputs, outputs, max_batch, "cpu", engine_cfg.instances,
                               int(batching.max_queue_delay_ms * 1000), path.name, dict(opts.parameters))
    args = {"model_config": config.triton_config(), "model_name": name, "model_version": version,
            "model_repository": str(path.parent), "parameters": dict(opts.parameters)}
    backend = PythonBackend(name, path, opts.class_name, args, instances=engine_cfg.instances,
                            timeout_s=opts.timeout_s, init_timeout_s=opts.init_timeout_s)
    # User code may have side effects: its answers are cached only when its own cache section asks for it.
    return TensorModelService(name, version, config, backend, batching=batching,
                              cache=cache or CacheConfig(enabled=False),
                              limits=limits, warm_with_inputs=False)


def attach_registry(service, registry) -> None:
    """Give a python model's in-process client the registry it calls models through."""
    attach = getattr(getattr(service, "backend", None), "attach", None)
    if attach is not None:
        attach(registry)

