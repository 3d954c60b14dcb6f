"""Typed configuration, one object per concern. Defaults live here, in code.

The CLI maps flags (and their SURGE_* environment variables) onto these
objects; nothing reads the environment at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineConfig(_Strict):
    """Which engine runs the model and how."""

    engine: Literal["onnxrt", "torch"] = Field("onnxrt", description="onnxrt (CPU) or torch (GPU, or CPU fallback).")
    device: str = Field("cpu", description="cpu, cuda or cuda:N.")
    precision: Literal["fp32", "fp16", "bf16", "int8"] = Field("fp32", description="Compute precision.")
    threads: int = Field(0, ge=0, description="Intra-op threads for the CPU engine; 0 lets the runtime choose.")
    instances: int = Field(1, ge=1, le=64, description="Engine copies run concurrently for this model.")
    max_batch_size: int = Field(64, ge=1, description="Largest batch the engine is run with.")
    max_seq_len: int | None = Field(None, ge=1, description="Truncation length; default: the model's own.")
    warmup_shapes: list[tuple[int, int]] = Field(
        default_factory=lambda: [(1, 16), (8, 32)], description="(batch, seq) shapes run before turning ready."
    )


class BatchingConfig(_Strict):
    """Dynamic batcher settings (per model)."""

    enabled: bool = Field(True, description="Off: every request runs alone (max batch 1).")
    max_batch_size: int = Field(64, ge=1, description="Most requests' inputs in one engine batch.")
    max_batch_tokens: int = Field(8192, ge=1, description="Token budget per batch (padded tokens for padded engines).")
    max_queue_delay_ms: float = Field(2.0, ge=0, description="Longest a request waits for others to join its batch.")
    max_queue_size: int = Field(2048, ge=1, description="Queued inputs above which new requests get 429.")
    max_padding_ratio: float = Field(
        0.25, ge=0, le=1, description="Padded engines: an input that would make more than this share of a batch "
        "padding waits for the next batch (padding costs as much compute as real tokens)."
    )
    max_inflight: int | None = Field(
        None, ge=1, description="Inputs admitted at once (queued, tokenizing or computing) before 429; "
        "default: max_queue_size plus one full batch per engine instance."
    )


class CacheConfig(_Strict):
    """Hot-query cache settings (per model)."""

    enabled: bool = Field(True, description="Serve repeated inputs from memory.")
    max_bytes: int = Field(64 * 1024 * 1024, ge=0, description="Byte bound of the recent tier.")
    pinned_top_k: int = Field(0, ge=0, description="Size of the pinned hot tier.")
    query_log: Path | None = Field(None, description="Query-log file (one query per line) that seeds the pinned tier.")
    learn_hot: bool = Field(True, description="Learn the hot set online with a frequency sketch.")
    recent_policy: Literal["lru", "tinylfu"] = Field(
        "tinylfu", description="Recent tier: plain LRU, or LRU with TinyLFU admission (keeps one-off queries out)."
    )
    redis_url: str | None = Field(None, description="Shared tier on Redis, e.g. redis://127.0.0.1:6379/0.")
    redis_ttl_s: int = Field(24 * 3600, ge=1, description="Time-to-live of entries in the shared tier.")


class LimitsConfig(_Strict):
    """Input limits enforced by the protocol layers."""

    max_inputs_per_request: int = Field(256, ge=1, description="Most inputs in one request.")
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="Largest request body accepted.")
    max_input_chars: int = Field(20_000, ge=1, description="Longest single text input, in characters.")
    request_timeout_s: float = Field(30.0, gt=0, description="A request still unanswered then gets 504.")


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port.")
    grpc_port: int | None = Field(8001, description="gRPC port (KServe v2); None disables gRPC.")
    api_key: str | None = Field(None, description="When set, every route but the health checks needs Bearer auth.")
    model_dir: Path | None = Field(None, description="Hugging Face model directory; default: the bundled MiniLM.")
    model_name: str | None = Field(None, description="Name the model is served under; default: from its directory.")
    model_repository: Path | None = Field(None, description="Directory of models/<name>/<version>/model.yaml.")
    cache_dir: Path | None = Field(None, description="Where exported artifacts are kept; default ~/.cache/surge.")
    log_level: str = Field("info", description="uvicorn log level.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)


def default_cache_dir() -> Path:
    """The artifact cache directory, resolved at call time (never at import)."""
    import os

    env = os.environ.get("SURGE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "surge"
