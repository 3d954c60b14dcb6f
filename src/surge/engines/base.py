"""The Engine contract: synchronous, batch in, batch out.

Engines know nothing about time, queues or asyncio; the runtime owns those.
An engine returns the encoder's last hidden state; pooling is shared code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from surge.types import Layout, TokenBatch


@dataclass(frozen=True)
class Capabilities:
    max_batch: int
    max_tokens: int  # longest sequence the engine accepts
    layout: Layout
    device: str
    dtype: str
    hidden_size: int


@runtime_checkable
class Engine(Protocol):
    capabilities: Capabilities

    def load(self, artifact: Path) -> None: ...

    def warmup(self, shapes: list[tuple[int, int]]) -> None: ...

    def run(self, batch: TokenBatch) -> np.ndarray:
        """Last hidden state: [B, L, H] for padded batches, [T, H] for packed ones."""
        ...

    def close(self) -> None: ...


def random_batch(batch: int, seq: int, vocab: int, layout: Layout = Layout.PADDED, seed: int = 0) -> TokenBatch:
    """A warm-up / test batch of real-looking token ids (never zeros)."""
    from surge.types import Encoded

    rng = np.random.default_rng(seed)
    items = []
    for _ in range(batch):
        ids = rng.integers(min(1000, vocab // 2), vocab, size=seq, dtype=np.int64)
        ids[0], ids[-1] = 101 if vocab > 102 else 1, 102 if vocab > 102 else 2
        items.append(Encoded(ids, np.zeros_like(ids)))
    return TokenBatch.pack(items) if layout is Layout.PACKED else TokenBatch.pad(items)
