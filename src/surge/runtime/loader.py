"""Building a ModelWorker from a model spec and an artifact."""

from __future__ import annotations

from pathlib import Path

from surge.config import EngineConfig
from surge.engines.base import Engine
from surge.models.hf import ModelSpec
from surge.runtime.slowdown import engine_delay_s, slow_down
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


def build_worker(spec: ModelSpec, artifact: Path | None, cfg: EngineConfig) -> ModelWorker:
    max_len = min(cfg.max_seq_len or spec.max_length, spec.max_length)
    tokenizer = Tokenizer(spec.tokenizer_file, max_length=max_len, vocab_size=spec.vocab_size, pad_id=spec.pad_token_id)
    engines = make_engines(cfg, spec, artifact)
    for engine in engines.engines:
        engine.warmup(cfg.warmup_shapes)
    slow_down(engines, engine_delay_s())  # a test-only setting; a no-op unless SURGE_TEST_ENGINE_DELAY_MS is set
    return ModelWorker(spec, tokenizer, engines, PostSpec(spec.pooling, spec.normalize))


def build_generate_service(spec: ModelSpec, version: str, cfg: EngineConfig, limits, generation=None):
    """A decoder directory -> a warmed-up GenerateService (paged KV cache, iteration scheduler).
    On the CPU it computes in fp32 or bf16; on a GPU in bf16 unless fp16/fp32 is asked for.
    `generation` (config.GenerationConfig): the server's settings merged with the model.yaml's."""
    from surge.config import GenerationConfig
    from surge.runtime.generate_service import load_generate_service

    device = f"cuda:{cfg.devices[0]}" if cfg.devices else cfg.device
    precision = cfg.precision
    if precision == "int8":
        from surge.errors import ConfigError

        raise ConfigError(f"{spec.path}: precision int8 is not supported for decoder models")
    if device.startswith("cuda") and precision == "fp32":
        precision = "bf16"  # the default precision means "the device's default" for decoders
    gen = (generation or GenerationConfig()).resolved(cfg)
    return load_generate_service(spec.path, spec.name, version, device=device, precision=precision,
                                 threads=cfg.threads, config=gen, request_timeout_s=limits.request_timeout_s)
