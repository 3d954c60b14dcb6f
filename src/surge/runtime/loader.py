"""Building a ModelWorker from a model spec and an artifact."""

from __future__ import annotations

from pathlib import Path

from surge.config import EngineConfig
from surge.engines.base import Engine
from surge.models.hf import ModelSpec
from surge.runtime.slowdown import engine_delay_s, slow_down
from surge.runtime.tokenize import Tokenizer
from surge.runtime.worker import EnginePool, ModelWorker, PostSpec


def make_engine(cfg: EngineConfig, spec: ModelSpec, artifact: Path | None, device: str | None = None,
                max_tokens: int | None = None) -> Engine:
    from surge.models.decoder import is_decoder_encoder_dir

    if is_decoder_encoder_dir(spec.path):  # either engine setting: a decoder's layers in torch
        from surge.engines.decoder.embedder import DecoderEmbedder

        dev, precision = decoder_device(spec, cfg, device)
        engine = DecoderEmbedder(device=dev, precision=precision, max_batch=cfg.max_batch_size, threads=cfg.threads,
                                 batch_invariant=cfg.batch_invariant)
        engine.load(spec.path)
        return engine
    if cfg.engine == "onnxrt":
        from surge.engines.onnxrt import OnnxRuntimeEngine

        engine = OnnxRuntimeEngine(threads=cfg.threads, max_batch=cfg.max_batch_size)
        engine.load(artifact)
        return engine
    if cfg.engine == "torch":
        from surge.engines.torch_gpu import TorchEngine

        engine = TorchEngine(device=device or cfg.device, precision=cfg.precision, max_batch=cfg.max_batch_size,
                             max_tokens=max_tokens, threads=cfg.threads, approximate_gelu=False if cfg.exact_gelu else None,
                             batch_invariant=cfg.batch_invariant)
        engine.load(spec.path)
        return engine
    raise ValueError(f"unknown engine {cfg.engine!r}")


def make_tensor_parallel_engine(cfg: EngineConfig, spec: ModelSpec) -> Engine:
    from surge.engines.tensor_parallel import TensorParallelEngine

    devices = cfg.devices
    if devices is None and cfg.device != "cpu":
        devices = list(range(cfg.tensor_parallel))
    engine = TensorParallelEngine(world=cfg.tensor_parallel, devices=devices, precision=cfg.precision,
                                  max_batch=cfg.max_batch_size, threads=cfg.threads,
                                  batch_invariant=cfg.batch_invariant)
    engine.load(spec.path)
    return engine


def make_engines(cfg: EngineConfig, spec: ModelSpec, artifact: Path | None, max_tokens: int | None = None):
    """EnginePool of `instances` engines; DevicePool over `devices`; one tensor-parallel engine."""
    if cfg.tensor_parallel > 1:  # one engine whose ranks hold all the devices
        return EnginePool([make_tensor_parallel_engine(cfg, spec)])
    if cfg.devices:
        from surge.runtime.devices import DevicePool

        labels = [f"cuda:{d}" for d in cfg.devices for _ in range(cfg.instances)]
        return DevicePool([make_engine(cfg, spec, artifact, device=d, max_tokens=max_tokens) for d in labels], labels)
    return EnginePool([make_engine(cfg, spec, artifact, max_tokens=max_tokens) for _ in range(cfg.instances)])


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
                                  spec.task_info.multi_label, spec.pooling, spec.hidden_size,
                                  pad_id=spec.config.get("pad_token_id"))])
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


def build_worker(spec: ModelSpec, artifact: Path | None, cfg: EngineConfig, heads=None,
                 batch_tokens: int | None = None) -> ModelWorker:
    """`batch_tokens`: the batcher's token budget; a packed engine then plans its workspace
    (and the shape buckets it builds before ready) for the batches it can really get: at most
    max(budget, one full-length input) tokens. `heads`: model.yaml's extra heads (build_heads)."""
    head_set = build_heads(spec, heads)
    max_len = min(cfg.max_seq_len or spec.max_length, spec.max_length)
    tokenizer = Tokenizer(spec.tokenizer_file, max_length=max_len, vocab_size=spec.vocab_size, pad_id=spec.pad_token_id)
    max_tokens = None if batch_tokens is None else (max(batch_tokens, max_len) + 15) // 16 * 16
    engines = make_engines(cfg, spec, artifact, max_tokens)
    if head_set is not None:  # GPU engines run the heads inside their captured graphs, ORT task graphs in theirs
        for engine in engines.engines:
            attach = getattr(engine, "attach_heads", None)
            if attach is not None:
                attach(head_set)
    elif any(getattr(e, "logits", False) for e in engines.engines):
        from surge.errors import ConfigError

        raise ConfigError(f"{artifact}: the ONNX graph returns a task head's logits; "
                          f"{spec.name} is served as task '{spec.task}' and needs the hidden states")
    else:  # CUDA torch engines pool inside their graphs (rows, not hidden states, come back)
        for engine in engines.engines:
            attach = getattr(engine, "attach_pooling", None)
            if attach is not None:
                attach(spec.pooling)
    for engine in engines.engines:
        engine.warmup(cfg.warmup_shapes)
    slow_down(engines, engine_delay_s())  # a test-only setting; a no-op unless SURGE_TEST_ENGINE_DELAY_MS is set
    return ModelWorker(spec, tokenizer, engines, PostSpec(spec.pooling, spec.normalize), head_set)


def generate_settings(spec: ModelSpec, cfg: EngineConfig, generation=None):
    """(device, precision, resolved GenerationConfig) of a decoder (decoder_device's device and precision)."""
    from surge.config import GenerationConfig

    device, precision = decoder_device(spec, cfg)
    return device, precision, (generation or GenerationConfig()).resolved(cfg)


def decoder_device(spec: ModelSpec, cfg: EngineConfig, device: str | None = None) -> tuple[str, str]:
    """(device, precision) of a decoder's engine (generation or embeddings): on the CPU fp32 or bf16; on a
    GPU bf16 unless a precision is set (`cfg.model_fields_set`: a flag, a SURGE_* variable or a
    model.yaml), so `--precision fp32` runs FP32 there as asked."""
    device = device or (f"cuda:{cfg.devices[0]}" if cfg.devices else cfg.device)
    precision = cfg.precision
    if precision == "int8":
        from surge.errors import ConfigError

        raise ConfigError(f"{spec.path}: precision int8 is not supported for decoder models")
    if device.startswith("cuda") and "precision" not in cfg.model_fields_set:
        precision = "bf16"  # the field's default means "the device's default" for decoders
    return device, precision


def build_generate_service(spec: ModelSpec, version: str, cfg: EngineConfig, limits, generation=None):
    """A decoder directory -> a warmed-up GenerateService (paged KV cache, iteration scheduler).
    `generation` (config.GenerationConfig): the server's settings merged with the model.yaml's."""
    from surge.runtime.generate_load import load_generate_service

    device, precision, gen = generate_settings(spec, cfg, generation)
    return load_generate_service(spec.path, spec.name, version, device=device, precision=precision,
                                 threads=cfg.threads, config=gen, request_timeout_s=limits.request_timeout_s)
