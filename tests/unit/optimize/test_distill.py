"""Distillation batches: every text once an epoch, and each batch made of groups of the teacher's nearest
neighbours (the retrieval the gate measures is decided between close texts)."""

from __future__ import annotations

import numpy as np
import torch

from surge.optimize.distill import _length_bucketed, _neighbour_batches


def _clustered(n_clusters: int, per: int, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_clusters, dim, generator=g) * 5
    pooled, label = [], []
    for c in range(n_clusters):
        for _ in range(per):
            pooled.append(centres[c] + 0.05 * torch.randn(dim, generator=g))
            label.append(c)
    return pooled, label


def test_every_text_once_per_epoch_in_full_batches():
    pooled, _ = _clustered(50, 4)
    encoded = [[1] * (1 + i % 13) for i in range(len(pooled))]
    batches = _neighbour_batches(encoded, pooled, 16, np.random.default_rng(0), k=4)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(pooled)))
    assert sum(len(b) == 16 for b in batches) >= len(batches) - 1


def test_groups_are_the_teachers_nearest_neighbours():
    # 64 tight clusters of 4: with the whole set in one chunk, each group of 4 must be one cluster
    pooled, label = _clustered(64, 4, seed=1)
    encoded = [[1, 2, 3]] * len(pooled)
    batches = _neighbour_batches(encoded, pooled, 16, np.random.default_rng(3), k=4)
    for b in batches:
        for g in range(0, len(b), 4):
            assert len({label[i] for i in b[g : g + 4]}) == 1, [label[i] for i in b]
    # random length buckets almost never do that
    random_batches = _length_bucketed(encoded, 16, np.random.default_rng(3))
    pure = sum(len({label[i] for i in b[g : g + 4]}) == 1 for b in random_batches for g in range(0, len(b), 4))
    assert pure < len(pooled) // 4 // 4


def test_reproducible_for_a_seed():
    pooled, _ = _clustered(20, 5, seed=2)
    encoded = [[1] * (1 + i % 7) for i in range(len(pooled))]
    a = _neighbour_batches(encoded, pooled, 8, np.random.default_rng(9), k=4)
    b = _neighbour_batches(encoded, pooled, 8, np.random.default_rng(9), k=4)
    assert a == b
