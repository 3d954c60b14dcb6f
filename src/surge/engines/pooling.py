"""Pooling and normalization, exactly as sentence-transformers defines them.

Works on padded [B, L, H] hidden states with a mask, or packed [T, H] with
cu_seqlens. Accumulates in float32 whatever the engine's dtype.
"""

from __future__ import annotations

import numpy as np

from surge.types import Layout, TokenBatch


def pool(hidden: np.ndarray, batch: TokenBatch, mode: str) -> np.ndarray:
    hidden = hidden.astype(np.float32, copy=False)
    if batch.layout is Layout.PACKED:
        return _pool_packed(hidden, batch.cu_seqlens, mode)
    mask = batch.attention_mask.astype(np.float32)[:, :, None]
    if mode == "mean":
        summed = (hidden * mask).sum(axis=1)
        counts = np.clip(mask.sum(axis=1), 1e-9, None)
        return summed / counts
    if mode == "cls":
        return hidden[:, 0, :].copy()
    if mode == "max":
        masked = np.where(mask > 0, hidden, -1e9)
        return masked.max(axis=1)
    if mode == "last":
        idx = batch.lengths - 1
        return hidden[np.arange(hidden.shape[0]), idx, :].copy()
    raise ValueError(f"unknown pooling mode {mode!r}")


def _pool_packed(hidden: np.ndarray, cu: np.ndarray, mode: str) -> np.ndarray:
    starts, ends = cu[:-1].astype(np.int64), cu[1:].astype(np.int64)
    if mode == "mean":
        sums = np.add.reduceat(hidden, starts, axis=0)
        return sums / (ends - starts)[:, None].astype(np.float32)
    if mode == "cls":
        return hidden[starts].copy()
    if mode == "max":
        return np.maximum.reduceat(hidden, starts, axis=0)
    if mode == "last":
        return hidden[ends - 1].copy()
    raise ValueError(f"unknown pooling mode {mode!r}")


def l2_normalize(x: np.ndarray) -> np.ndarray:
    # Same epsilon as torch.nn.functional.normalize, which sentence-transformers uses.
    if x.dtype.kind == "f":  # np.linalg.norm's own arithmetic for real rows, without its Python checks
        norms = np.sqrt(np.add.reduce(x * x, axis=1, keepdims=True))
    else:
        norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)
