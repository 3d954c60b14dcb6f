"""One request as it moves through the runtime: what every stage reads and writes.

Stages (runtime/service.py): parse (server/) -> admit -> cache -> coalesce ->
tokenize -> batch -> engine -> post-process -> respond. Each stage fills the
request's per-input slots or its timings; nothing else carries state between
stages. One deadline (a time.monotonic() value) bounds the whole request.
The timings go back with the result (EmbedResult.timings, nanoseconds) and
from there into KServe statistics and response headers, as TEI does: one
place measures, every protocol reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from surge.types import EmbedOptions, EmbedResult

# EmbedResult.timings keys (ns), named as KServe's statistics stages
QUEUE, TOKENIZE, INFER, POST = "queue_ns", "compute_input_ns", "compute_infer_ns", "compute_output_ns"
# EmbedResult.timings' count of the engine batches the request was the first caller of (runtime/batcher.py):
# summed over requests, the model's executions (KServe's execution_count)
EXECUTIONS = "executions"
# response headers of each stage (milliseconds, like TEI's x-*-time headers)
HEADERS = {TOKENIZE: b"x-surge-tokenize-ms", QUEUE: b"x-surge-queue-ms", INFER: b"x-surge-inference-ms",
           POST: b"x-surge-postprocess-ms"}


@dataclass(eq=False, slots=True)
class Request:
    inputs: list  # texts or token-id lists
    is_text: bool
    options: EmbedOptions
    deadline: float
    priority: int = 0
    started: float = field(default_factory=time.monotonic)
    vectors: list = field(default_factory=list)  # per-input slots: np.ndarray once filled
    tokens: list = field(default_factory=list)
    cached: list = field(default_factory=list)
    keys: list | None = None  # cache keys, when the model has a cache
    timings: dict = field(default_factory=dict)  # stage -> ns

    def __post_init__(self):
        n = len(self.inputs)
        self.vectors = [None] * n
        self.tokens = [0] * n
        self.cached = [False] * n

    @property
    def n(self) -> int:
        return len(self.inputs)

    def fill(self, i: int, vector: np.ndarray, tokens: int, cached: bool = False) -> None:
        self.vectors[i], self.tokens[i], self.cached[i] = vector, tokens, cached

    def add_time(self, stage: str, seconds: float) -> None:
        self.timings[stage] = self.timings.get(stage, 0) + int(seconds * 1e9)

    def result(self, model: str, version: str, dimensions: int) -> EmbedResult:
        out = np.stack(self.vectors) if self.n else np.zeros((0, dimensions), np.float32)
        return EmbedResult(out, sum(self.tokens), model, version, list(self.cached), list(self.tokens),
                           timings=dict(self.timings))


def timing_headers(result) -> list[tuple[bytes, bytes]]:
    """(name, value) response headers of a result's stage timings (ms); none for remote results."""
    t = getattr(result, "timings", None)
    if not t:
        return []
    return [(h, f"{t[k] / 1e6:.3f}".encode()) for k, h in HEADERS.items() if k in t]


def response_headers(result) -> dict[str, str]:
    """The model version and stage timings as a str dict (for framework responses)."""
    out = {"x-surge-model-version": result.version}
    out.update((k.decode(), v.decode()) for k, v in timing_headers(result))
    return out
