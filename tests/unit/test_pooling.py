"""Pooling and normalization against float64 math on fresh random inputs."""

import numpy as np
import pytest

from surge.engines.pooling import l2_normalize, pool
from surge.types import Encoded, TokenBatch


def _batch(rng, lengths):
    items = [Encoded(rng.integers(1, 1000, n), np.zeros(n, dtype=np.int64)) for n in lengths]
    return TokenBatch.pad(items), TokenBatch.pack(items)


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "last"])
def test_padded_and_packed_pooling_match_float64(mode):
    rng = np.random.default_rng()
    lengths = list(rng.integers(1, 17, size=int(rng.integers(1, 9))))
    padded, packed = _batch(rng, lengths)
    hidden = rng.standard_normal((padded.size, padded.input_ids.shape[1], 8)).astype(np.float32)
    # Garbage in padded positions must not leak into any pooling mode.
    hidden[padded.attention_mask == 0] = 1e6
    flat = np.concatenate([hidden[i, :n] for i, n in enumerate(lengths)])
    expected = []
    for i, n in enumerate(lengths):
        rows = hidden[i, :n].astype(np.float64)
        expected.append({"mean": rows.mean(0), "cls": rows[0], "max": rows.max(0), "last": rows[-1]}[mode])
    expected = np.stack(expected)
    np.testing.assert_allclose(pool(hidden, padded, mode), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pool(flat, packed, mode), expected, rtol=1e-5, atol=1e-5)


def test_l2_normalize_matches_float64():
    x = np.random.default_rng().standard_normal((7, 33)).astype(np.float32)
    ref = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    np.testing.assert_allclose(l2_normalize(x), ref, rtol=1e-6, atol=1e-7)


def test_pack_layout_offsets():
    rng = np.random.default_rng()
    lengths = [3, 1, 5]
    padded, packed = _batch(rng, lengths)
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 9]
    assert padded.input_ids.shape == (3, 5) and padded.padded_tokens == 15 and packed.padded_tokens == 9
    assert packed.input_ids[3] == padded.input_ids[1, 0]
