"""Per model-version inference statistics, in the shape of KServe v2's statistics
extension (Triton's ModelStatistics): counts and cumulative nanoseconds.

Recorded once per request by AppState.run, whatever protocol it came in by.
All updates happen on the event loop, so no lock is needed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += max(0, int(ns))

    def as_dict(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class InferStats:
    """Triton's InferStatistics: one Duration per stage."""

    success: Duration = field(default_factory=Duration)  # whole request, successful ones
    fail: Duration = field(default_factory=Duration)  # whole request, failed ones
    queue: Duration = field(default_factory=Duration)  # waiting for a batch (when the runtime reports it)
    compute_input: Duration = field(default_factory=Duration)  # tokenizing and batch building (when reported)
    compute_infer: Duration = field(default_factory=Duration)  # engine run (when reported)
    compute_output: Duration = field(default_factory=Duration)  # pooling, normalizing (when reported)
    cache_hit: Duration = field(default_factory=Duration)  # requests answered wholly from the cache
    cache_miss: Duration = field(default_factory=Duration)  # requests that ran the model

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name).as_dict() for f in fields(self)}


@dataclass
class ModelStats:
    name: str
    version: str
    last_inference_ms: int = 0  # ms since the epoch
    inference_count: int = 0  # inputs answered (each input of a batched request counts)
    execution_count: int = 0  # model executions: requests that ran the model
    inference_stats: InferStats = field(default_factory=InferStats)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": self.inference_stats.as_dict(),
            "batch_stats": [],
        }


# Stage timings a result carries (nanoseconds, EmbedResult.timings: runtime/request.py
# measures them); recorded when present.
STAGES = ("queue_ns", "compute_input_ns", "compute_infer_ns", "compute_output_ns")


class InferenceStats:
    def __init__(self) -> None:
        self._models: dict[tuple[str, str], ModelStats] = {}

    def model(self, name: str, version: str) -> ModelStats:
        key = (name, str(version))
        stats = self._models.get(key)
        if stats is None:
            stats = self._models[key] = ModelStats(name, str(version))
        return stats

    def record_success(self, name: str, version: str, result, elapsed_ns: int, cache_enabled: bool = False) -> None:
        stats = self.model(name, version)
        n = len(result.vectors)
        stats.last_inference_ms = int(time.time() * 1000)
        stats.inference_count += n
        s = stats.inference_stats
        s.success.add(elapsed_ns)
        cached = list(getattr(result, "cached", None) or [])
        if cached and all(cached):
            s.cache_hit.add(elapsed_ns)
            return
        stats.execution_count += 1
        if cache_enabled:  # as Triton: cache counters only for models with a cache
            s.cache_miss.add(elapsed_ns)
        timings = getattr(result, "timings", None) or {}
        for stage in STAGES:
            ns = timings.get(stage, getattr(result, stage, None))
            if ns is not None:
                getattr(s, stage[: -len("_ns")]).add(ns)

    def record_generation(self, name: str, version: str, elapsed_ns: int, timings: dict | None, cached: bool,
                          cache_enabled: bool = False) -> None:
        """One finished generation (a decoder model): a request is one inference; its stages are the
        time before admission (queue), the prefill up to the first token (compute_input) and the
        decode (compute_infer). A generation answered from the cache is a cache hit, not an execution."""
        stats = self.model(name, version)
        stats.last_inference_ms = int(time.time() * 1000)
        stats.inference_count += 1
        s = stats.inference_stats
        s.success.add(elapsed_ns)
        if cached:
            s.cache_hit.add(elapsed_ns)
            return
        stats.execution_count += 1
        if cache_enabled:
            s.cache_miss.add(elapsed_ns)
        for stage in STAGES:
            ns = (timings or {}).get(stage)
            if ns is not None:
                getattr(s, stage[: -len("_ns")]).add(ns)

    def record_failure(self, name: str, version: str, elapsed_ns: int) -> None:
        stats = self.model(name, version)
        stats.last_inference_ms = int(time.time() * 1000)
        stats.inference_stats.fail.add(elapsed_ns)
