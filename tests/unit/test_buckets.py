"""The torch engine's shape buckets (engines/buckets.py), without a GPU: bounded, and
every batch the engine accepts maps to one of them with bounded padding."""

from __future__ import annotations

import numpy as np
import pytest

from surge.engines.buckets import SHORT, Buckets, token_steps


def test_token_steps_are_multiples_of_16_growing_at_most_1_5x():
    steps = token_steps(8192)
    assert steps[0] == 16 and steps[-1] == 8192
    assert all(t % 16 == 0 for t in steps)
    assert all(1 < b / a <= 2 for a, b in zip(steps, steps[1:]))
    assert all(b / a <= 1.5 for a, b in zip(steps[1:], steps[2:]))
    assert token_steps(8704)[-1] == 8704  # a capacity off the ladder is a step of its own


@pytest.mark.parametrize("max_batch,max_len,cap", [(64, 512, 8192), (64, 256, 16384), (32, 128, 4096),
                                                   (8, 512, 4096), (1, 64, 64), (128, 512, 32768)])
def test_every_accepted_batch_maps_to_a_bucket_of_the_set(max_batch, max_len, cap):
    b = Buckets(max_batch, max_len, cap)
    assert len(b) <= 2 * len(b.tokens) <= 60  # bounded: what warm-up captures
    assert len(set(b.keys)) == len(b.keys)
    rng = np.random.default_rng(max_batch * max_len)
    keys = set(b.keys)
    used = set()
    for _ in range(4000):
        n = int(rng.integers(1, max_batch + 1))
        # short single sentences mostly, some long documents
        top = max_len if rng.random() < 0.2 else min(max_len, 40)
        lengths = rng.integers(1, top + 1, n)
        while lengths.sum() > cap:
            lengths = lengths[:-1]
        if not len(lengths):
            continue
        t = int(lengths.sum())
        bb, tb, lb = key = b.key(len(lengths), t, int(lengths.max()))
        assert key in keys, key
        used.add(key)
        assert t <= tb <= cap and len(lengths) <= bb and lengths.max() <= lb
        assert tb <= max(16, 1.5 * t) + 16  # padded tokens bounded
        if lengths.max() <= SHORT and tb <= bb * SHORT:
            assert lb <= SHORT  # short batches keep the attention kernel's small blocks
    assert len(used) > 3


def test_a_batch_beyond_capacity_fits_no_bucket():
    b = Buckets(64, 512, 8192)
    with pytest.raises(ValueError, match="fits no bucket"):
        b.key(20, 9000, 500)
    with pytest.raises(ValueError, match="fits no bucket"):
        b.key(1, 600, 600)


def test_every_bucket_can_be_built_from_full_sequences():
    """TorchEngine._build stages min(bb, ceil(tb / lb)) sequences of lb tokens: valid for every key."""
    b = Buckets(64, 512, 8192)
    for bb, tb, lb in b.keys:
        lens = [lb] * (tb // lb) + ([tb % lb] if tb % lb else [])
        lens = lens[:bb]
        assert 1 <= len(lens) <= bb and max(lens) <= lb and sum(lens) <= tb
        assert b.key(len(lens), sum(lens), max(lens))[1] <= tb
