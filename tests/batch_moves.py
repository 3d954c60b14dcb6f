"""Which items of a packed engine's output change with their batch-mates (DESIGN.md: a result never depends
on which other requests shared its batch)."""

from __future__ import annotations

import numpy as np


def moved(run, items, rng, batches: int) -> list[int]:
    """Indices of items whose hidden states in some random batch (2-64 items) differ from theirs alone."""
    alone = [run([it]) for it in items]
    order = rng.permutation(len(items)).tolist()
    groups = []
    while order:  # every item in at least one batch ...
        n = int(rng.integers(2, 65))
        groups.append(order[:n])
        order = order[n:]
    groups += [rng.choice(len(items), int(rng.integers(2, 65)), replace=False).tolist() for _ in range(batches)]
    out = set()
    for g in groups:  # ... and some in several, with other batch-mates and offsets
        h = run([items[i] for i in g])
        off = 0
        for i in g:
            n = len(items[i].ids)
            if not np.array_equal(h[off:off + n], alone[i]):
                out.add(i)
            off += n
    return sorted(out)
