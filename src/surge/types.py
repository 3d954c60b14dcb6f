"""Data that crosses module boundaries: token batches, requests and results.

Arrays are numpy so that engines, the runtime and the protocols agree on one
representation without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class Layout(str, Enum):
    """How an engine wants a batch laid out."""

    PADDED = "padded"  # [batch, max_len] with an attention mask
    PACKED = "packed"  # [total_tokens] with cu_seqlens, no padding


@dataclass(frozen=True)
class Encoded:
    """One tokenized input (no padding)."""

    ids: np.ndarray  # int64 [n]
    type_ids: np.ndarray  # int64 [n]

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class TokenBatch:
    """A batch ready for an engine.

    Padded: input_ids/attention_mask/token_type_ids are [B, L].
    Packed: the same arrays are [T] and cu_seqlens is [B+1] (int32).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    lengths: np.ndarray  # int64 [B], real tokens per row
    layout: Layout = Layout.PADDED
    cu_seqlens: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        if self.layout is Layout.PACKED:
            return self.real_tokens
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])

    @classmethod
    def pad(cls, items: list[Encoded], pad_id: int = 0, pad_to: int | None = None) -> "TokenBatch":
        if not items:
            raise ValueError("cannot build an empty batch")
        lengths = np.array([len(e) for e in items], dtype=np.int64)
        width = int(lengths.max()) if pad_to is None else max(int(pad_to), int(lengths.max()))
        ids = np.full((len(items), width), pad_id, dtype=np.int64)
        types = np.zeros((len(items), width), dtype=np.int64)
        mask = np.zeros((len(items), width), dtype=np.int64)
        for row, enc in enumerate(items):
            n = len(enc)
            ids[row, :n] = enc.ids
            types[row, :n] = enc.type_ids
            mask[row, :n] = 1
        return cls(ids, mask, types, lengths, Layout.PADDED)

    @classmethod
    def pack(cls, items: list[Encoded]) -> "TokenBatch":
        if not items:
            raise ValueError("cannot build an empty batch")
        if len(items) == 1:  # a lone request (the latency case): its own arrays, nothing to join
            e = items[0]
            ids = np.asarray(e.ids, dtype=np.int64)
            n = len(ids)
            return cls(ids, np.ones_like(ids), np.asarray(e.type_ids, dtype=np.int64), np.array([n], dtype=np.int64),
                       Layout.PACKED, np.array([0, n], dtype=np.int32))
        lengths = np.array([len(e) for e in items], dtype=np.int64)
        cu = np.zeros(len(items) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        ids = np.concatenate([e.ids for e in items]).astype(np.int64, copy=False)
        types = np.concatenate([e.type_ids for e in items]).astype(np.int64, copy=False)
        return cls(ids, np.ones_like(ids), types, lengths, Layout.PACKED, cu)


@dataclass
class EmbedOptions:
    """Request options that change the output (and so belong in cache keys)."""

    normalize: bool | None = None  # None: as the model's config says
    truncate: bool = True
    dimensions: int | None = None  # Matryoshka-style truncation of the output
    # one of the model's sentence-transformers prompts, put before every text (None: its default, if any);
    # the prompted texts key the cache, so the name is not in key()
    prompt_name: str | None = None
    # which end of a too-long input is cut: "right" keeps its first tokens, "left" its last (TEI's
    # truncation_direction); the model's special tokens stay around what is kept either way
    truncation_direction: str = "right"

    @property
    def left(self) -> bool:
        """Cut from the left (only where cutting applies: truncate=False refuses instead)."""
        return self.truncate and self.truncation_direction == "left"

    def key(self) -> tuple:
        # the direction where it changes the answer: a left-cut vector never answers a right-cut request
        return (self.normalize, self.truncate, self.dimensions, "left" if self.left else "right")


@dataclass
class EmbedResult:
    """Embeddings for one request (one row per input)."""

    vectors: np.ndarray  # float32 [n, dim]
    prompt_tokens: int
    model: str
    version: str
    cached: list[bool] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # per input: the tokens computed (after truncation)
    # stage timings in ns (runtime/request.py: queue_ns, compute_input_ns, compute_infer_ns,
    # compute_output_ns); None where the runtime did not measure (a remote model)
    timings: dict | None = None
