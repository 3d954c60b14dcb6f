"""The body of a model's Ray Serve deployment: one whole surge ModelService per
replica (engine, batcher, cache), plus the engine check Ray calls for health.

Plain Python: `ray_serve.py` turns `ModelReplica` into a deployment. Nothing
here needs Ray except naming the replica, so tests can also build one in-process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from surge.config import BatchingConfig, CacheConfig, EngineConfig, GenerationConfig, LimitsConfig
from surge.errors import EngineError
from surge.types import EmbedOptions, EmbedResult

log = logging.getLogger("surge.distributed")

# A fixed real sentence: the health check embeds it and compares with the vector
# the replica computed when it started, which catches a dead or corrupted engine.
PROBE_TEXT = "The quick brown fox jumps over the lazy dog."
PROBE_MIN_COSINE = 0.999


@dataclass
class ReplicaSpec:
    """Everything a replica needs to build its ModelService (picklable).

    The driver resolves (exports) the artifact once, so replicas only load it.
    """

    name: str
    version: str
    model_dir: Path
    artifact: Path | None
    engine: EngineConfig
    batching: BatchingConfig
    cache: CacheConfig
    limits: LimitsConfig
    task: str = "embed"  # "generate": a decoder model, served by generate_replica.GenerateReplica
    generation: GenerationConfig | None = None  # decoder models' settings (server's merged with model.yaml's)


def replica_identity() -> str:
    """`<ray replica id>:<pid>` inside Ray Serve, `local:<pid>` outside it."""
    unique = "local"
    if "ray" in sys.modules:  # inside a replica Ray is loaded; never import it just to ask
        try:
            from ray import serve

            rid = serve.get_replica_context().replica_id
            unique = getattr(rid, "unique_id", None) or str(rid)
        except Exception:  # not running inside a Serve replica
            pass
    return f"{unique}:{os.getpid()}"


def build_service(spec: ReplicaSpec):
    """The same ModelService a single `surge serve` process builds (cli/bootstrap.py)."""
    from surge.models import load_model_spec
    from surge.runtime.loader import build_worker
    from surge.runtime.service import ModelService

    model_spec = load_model_spec(spec.model_dir, name=spec.name)
    worker = build_worker(model_spec, spec.artifact, spec.engine)
    return ModelService(spec.name, spec.version, worker, batching=spec.batching, cache=spec.cache,
                        limits=spec.limits)


class ModelReplica:
    """One replica of one model version."""

    def __init__(self, spec: ReplicaSpec):
        started = time.perf_counter()
        self.spec = spec
        self.identity = replica_identity()
        self.service = build_service(spec)
        self._probe_items = self.service.worker.tokenizer.encode([PROBE_TEXT])
        self._probe = self.service.worker.compute(self._probe_items)[0].astype(np.float64)
        self.service.mark_ready()
        log.info("replica %s of %s v%s ready in %.1f s", self.identity, spec.name, spec.version,
                 time.perf_counter() - started)

    async def embed(self, texts: list[str] | None = None, token_ids: list[list[int]] | None = None,
                    options: EmbedOptions | None = None) -> tuple[EmbedResult, str]:
        """The service's answer and who computed it (the ingress reports it)."""
        result = await self.service.embed(texts=texts, token_ids=token_ids, options=options)
        return result, self.identity

    async def info(self) -> dict:
        s = self.service
        return {"name": s.name, "version": s.version, "dimensions": s.dimensions, "max_length": s.max_length,
                "loaded_at": s.loaded_at, "replica": self.identity,
                "capabilities": s.worker.engines.capabilities}

    async def check_health(self) -> None:
        """Ray calls this periodically; raising makes Ray replace the replica."""
        if not self.service.ready:
            raise EngineError(f"replica {self.identity}: service is not ready")
        # Off the event loop, so that requests keep flowing during the check.
        await asyncio.to_thread(self.check_engine)

    def check_engine(self) -> None:
        """Run the engine on the probe; fail unless it answers the startup vector."""
        try:
            vec = self.service.worker.compute(self._probe_items)[0].astype(np.float64)
        except Exception as exc:
            raise EngineError(f"replica {self.identity}: engine check failed: {type(exc).__name__}: {exc}") from None
        cos = float(vec @ self._probe / (np.linalg.norm(vec) * np.linalg.norm(self._probe) or 1.0))
        if not np.isfinite(vec).all() or cos < PROBE_MIN_COSINE:
            raise EngineError(f"replica {self.identity}: engine check gave a wrong vector (cosine {cos:.4f})")

    async def close(self) -> None:
        await self.service.close()
