"""Building a ModelWorker from a model spec and an artifact."""

from __future__ import annotations

from pathlib import Path

from surge.config import EngineConfig
from surge.engines.base import Engine
from surge.models.hf import ModelSpec
from surge.runtime.tokenize import Tokenizer
from surge.runtime.worker import EnginePool, ModelWorker, PostSpec


def make_engine(cfg: EngineConfig, spec: ModelSpec, artifact: Path | None) -> Engine:
    if cfg.engine == "onnxrt":
        from surge.engines.onnxrt import OnnxRuntimeEngine

        engine = OnnxRuntimeEngine(threads=cfg.threads, max_batch=cfg.max_batch_size)
        engine.load(artifact)
        return engine
    if cfg.engine == "torch":
        from surge.engines.torch_gpu import TorchEngine

        engine = TorchEngine(device=cfg.device, precision=cfg.precision, max_batch=cfg.max_batch_size)
        engine.load(spec.path)
        return engine
    raise ValueError(f"unknown engine {cfg.engine!r}")


def build_worker(spec: ModelSpec, artifact: Path | None, cfg: EngineConfig) -> ModelWorker:
    max_len = min(cfg.max_seq_len or spec.max_length, spec.max_length)
    tokenizer = Tokenizer(spec.tokenizer_file, max_length=max_len, vocab_size=spec.vocab_size, pad_id=spec.pad_token_id)
    engines = EnginePool([make_engine(cfg, spec, artifact) for _ in range(cfg.instances)])
    for engine in engines.engines:
        engine.warmup(cfg.warmup_shapes)
    return ModelWorker(spec, tokenizer, engines, PostSpec(spec.pooling, spec.normalize))
