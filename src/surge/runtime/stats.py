"""Per model-version inference statistics, in the shape of KServe v2's statistics
extension (Triton's ModelStatistics): counts and cumulative nanoseconds.

Recorded once per request by AppState.run, whatever protocol it came in by.
All updates happen on the event loop, so no lock is needed.

Under `--workers` every front end counts its own requests, and a statistics
request reaches whichever front end the kernel picked: so each process also
mirrors its totals into memory-mapped files of its own in the metrics
directory (as prometheus_client does for /metrics), and `snapshot()` sums
every process's files: the answer is whole and current whichever front end
gives it, and survives a front end restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass, field, fields

import numpy as np

from surge.runtime.request import EXECUTIONS


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
    execution_count: int = 0  # model executions: engine batches run (a generation: one a request)
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


_STAGES = tuple(f.name for f in fields(InferStats))
_WIDTH = 3 + 2 * len(_STAGES)  # last_inference, inference_count, execution_count, then count and ns per stage


def _values(stats: ModelStats) -> list[float]:
    """One model version's statistics as a flat vector (the mirror's file layout)."""
    out = [stats.last_inference_ms, stats.inference_count, stats.execution_count]
    s = stats.inference_stats
    for name in _STAGES:
        d = getattr(s, name)
        out += (d.count, d.ns)
    return out


def _from_values(name: str, version: str, values) -> ModelStats:
    """_values' inverse."""
    v = [int(x) for x in values]
    stats = ModelStats(name, version, last_inference_ms=v[0], inference_count=v[1], execution_count=v[2])
    for i, stage in enumerate(_STAGES):
        d = getattr(stats.inference_stats, stage)
        d.count, d.ns = v[3 + 2 * i], v[4 + 2 * i]
    return stats


class _Mirror:
    """This process's totals, one small memory-mapped float64 file per model version (counts exact;
    cumulative nanoseconds exact up to 2**53, about 104 days of request time per process). The file
    name carries the process and a hash of the model version, so a reader finds every process's file
    of one version by name alone. One vector store per answered request (+3.7 us, benchmarks/cpu_parts.py)."""

    def __init__(self, directory: str, tag: str | None = None):
        self.directory = os.path.join(directory, "kserve_stats")
        os.makedirs(self.directory, exist_ok=True)
        self.tag = str(tag or os.getpid())
        self._files: dict[tuple[str, str], np.memmap] = {}

    @staticmethod
    def _key(name: str, version: str) -> str:
        return hashlib.sha1(json.dumps([name, version]).encode()).hexdigest()[:20]

    def write(self, stats: ModelStats) -> None:
        values = self._files.get((stats.name, stats.version))
        if values is None:
            path = os.path.join(self.directory, f"{self.tag}-{self._key(stats.name, stats.version)}.f64")
            values = self._files[(stats.name, stats.version)] = np.memmap(path, np.float64, "w+", shape=(_WIDTH,))
        values[:] = _values(stats)

    def read(self, name: str, version: str) -> np.ndarray:
        """Every process's values for one model version: summed, and the latest last_inference."""
        suffix = f"-{self._key(name, version)}.f64"
        total = np.zeros(_WIDTH)
        latest = 0.0
        for entry in os.scandir(self.directory):
            if entry.name.endswith(suffix):
                values = np.fromfile(entry.path, np.float64)
                if values.shape == total.shape:  # a file being created this instant has no values yet
                    total += values
                    latest = max(latest, values[0])
        total[0] = latest
        return total


class InferenceStats:
    def __init__(self, shared_dir: str | None = None, tag: str | None = None) -> None:
        """shared_dir: the --workers metrics directory (runtime/metrics.multiprocess_dir), or None;
        tag: this process's file name in it (default: its pid)."""
        self._models: dict[tuple[str, str], ModelStats] = {}
        self._mirror = _Mirror(shared_dir, tag) if shared_dir else None
        self._dirty: dict[int, ModelStats] = {}  # changed this loop pass, not yet mirrored
        self._flush_on = None  # the loop a _flush is scheduled on

    def model(self, name: str, version: str) -> ModelStats:
        """This process's statistics of one model version (what it records into)."""
        key = (name, str(version))
        stats = self._models.get(key)
        if stats is None:
            stats = self._models[key] = ModelStats(name, str(version))
        return stats

    def forget(self, name: str, version: str) -> None:
        """A model version that will not come back under this name (an unloaded LoRA adapter): its
        statistics go. Recording it again starts it afresh."""
        self._models.pop((name, str(version)), None)

    def snapshot(self, name: str, version: str) -> dict:
        """The KServe / Triton statistics of one model version, whole across front-end processes."""
        own = self.model(name, version)
        if self._mirror is None:
            return own.as_dict()
        self._mirror.write(own)  # a version nobody has called yet still gets its (zero) row
        return _from_values(name, str(version), self._mirror.read(name, str(version))).as_dict()

    def _changed(self, stats: ModelStats) -> None:
        """Mirror `stats` once at the end of this loop pass (at once without a running loop).

        A memmap store a request was the costliest part of a record; a pass that answers many
        requests now stores each model version once. Another process's snapshot sees them one pass
        later, as /metrics does (runtime/metrics_buffer.py); this process's own snapshot writes first."""
        if self._mirror is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._mirror.write(stats)
            return
        self._dirty[id(stats)] = stats
        if self._flush_on is not loop:  # none pending, or pending on a loop that closed before running it
            self._flush_on = loop
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_on = None
        dirty, self._dirty = self._dirty, {}
        for stats in dirty.values():
            self._mirror.write(stats)

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
            self._changed(stats)
            return
        timings = getattr(result, "timings", None) or {}
        # the batches this request was the first caller of (runtime/batcher.py): requests sharing a batch
        # count it once, as Triton; a result from elsewhere (a remote model) counts its one call
        stats.execution_count += timings.get(EXECUTIONS, 1)
        if cache_enabled:  # as Triton: cache counters only for models with a cache
            s.cache_miss.add(elapsed_ns)
        for stage in STAGES:
            ns = timings.get(stage, getattr(result, stage, None))
            if ns is not None:
                getattr(s, stage[: -len("_ns")]).add(ns)
        self._changed(stats)

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
            self._changed(stats)
            return
        stats.execution_count += 1
        if cache_enabled:
            s.cache_miss.add(elapsed_ns)
        for stage in STAGES:
            ns = (timings or {}).get(stage)
            if ns is not None:
                getattr(s, stage[: -len("_ns")]).add(ns)
        self._changed(stats)

    def record_failure(self, name: str, version: str, elapsed_ns: int) -> None:
        stats = self.model(name, version)
        stats.last_inference_ms = int(time.time() * 1000)
        stats.inference_stats.fail.add(elapsed_ns)
        self._changed(stats)
