"""Building a ModelWorker from a model spec and an artifact."""

from __future__ import annotations

from pathlib import Path

from surge.config import EngineConfig
from surge.engines.base import Engine
from surge.models.hf import ModelSpec
from surge.runtime.tokenize import Tokenizer
from surge.runtime.worker import EnginePool, ModelWorker, PostSpec


def make_engine(cfg: EngineConfig, spec: ModelSpec, artifact: Path | None, device: str | None = None) -> Engine:
    if cfg.engine == "onnxrt":
        from surge.engines.onnxrt import OnnxRuntimeEngine

        engine = OnnxRuntimeEngine(threads=cfg.threads, max_batch=cfg.max_batch_size)
        engine.load(artifact)
        return engine
    if cfg.engine == "torch":
        from surge.engines.torch_gpu import TorchEngine

        engine = TorchEngine(device=device or cfg.device, precision=cfg.precision, max_batch=cfg.max_batch_size,
                             threads=cfg.threads, approximate_gelu=False if cfg.exact_gelu else None)
        engine.load(spec.path)
        return engine
    raise ValueError(f"unknown engine {cfg.engine!r}")


def make_tensor_parallel_engine(cfg: EngineConfig, spec: ModelSpec) -> Engine:
    from surge.engines.tensor_parallel import TensorParallelEngine

    devices = cfg.devices
    if devices is None and cfg.device != "cpu":
        devices = list(range(cfg.tensor_parallel))
    engine = TensorParallelEngine(world=cfg.tensor_parallel, devices=devices, precision=cfg.precision,
                                  max_batch=cfg.max_batch_size, threads=cfg.threads)
    engine.load(spec.path)
    return engine


def make_engines(cfg: EngineConfig, spec: ModelSpec, artifact: Path | None):
    """EnginePool of `instances` engines; DevicePool over `devices`; one tensor-parallel engine."""
    if cfg.tensor_parallel > 1:  # one engine whose ranks hold all the devices
        return EnginePool([make_tensor_parallel_engine(cfg, spec)])
    if cfg.devices:
        from surge.runtime.devices import DevicePool

        labels = [f"cuda:{d}" for d in cfg.devices for _ in range(cfg.instances)]
        return DevicePool([make_engine(cfg, spec, artifact, device=d) for d in labels], labels)
    return EnginePool([make_engine(cfg, spec, artifact) for _ in range(cfg.instances)])


def build_heads(spec: ModelSpec, extra=None):
    """The HeadSet of a task model (None for a plain embedding model).

    `extra`: model.yaml's `heads` (several heads on this backbone, encode once); each entry has
    name, task and the model directory holding the trained head (`source`)."""
    from surge.engines.heads import HeadSet, load_head
    from surge.models.tasks import check_servable

    check_servable(spec.task_info, spec.model_type, spec.path)
    if not extra:
        if spec.task == "embed":
            return None
        return HeadSet([load_head(spec.path, spec.name, spec.task, spec.model_type, spec.labels,
                                  spec.task_info.multi_label, spec.pooling, spec.hidden_size)])
    from surge.models.hf import load_model_spec
    from surge.models.multihead import check_same_backbone

    heads = []
    for h in extra:
        if h.task == "embed":
            heads.append(load_head(spec.path, h.name, "embed", spec.model_type, (), pooling=spec.pooling,
                                   hidden=spec.hidden_size))
            continue
        hs = load_model_spec(h.source, task=h.task)
        check_same_backbone(spec, hs, h.name)
        heads.append(load_head(hs.path, h.name, hs.task, hs.model_type, hs.labels, hs.task_info.multi_label))
    return HeadSet(heads)


def build_worker(spec: ModelSpec, artifact: Path | None, cfg: EngineConfig, heads=None) -> ModelWorker:
    head_set = build_heads(spec, heads)
    max_len = min(cfg.max_seq_len or spec.max_length, spec.max_length)
    tokenizer = Tokenizer(spec.tokenizer_file, max_length=max_len, vocab_size=spec.vocab_size, pad_id=spec.pad_token_id)
    engines = make_engines(cfg, spec, artifact)
    if head_set is not None:  # GPU engines run the heads inside their captured graphs
        for engine in engines.engines:
            attach = getattr(engine, "attach_heads", None)
            if attach is not None:
                attach(head_set)
    for engine in engines.engines:
        engine.warmup(cfg.warmup_shapes)
    return ModelWorker(spec, tokenizer, engines, PostSpec(spec.pooling, spec.normalize), head_set)
