"""The gate's statistics and its serving layout (pure functions; float64 references)."""

from __future__ import annotations

import numpy as np

from surge.optimize.int8_search import search_budget
from surge.optimize.validate import BUDGETS, SERVING_BATCH_SIZES, Budget, Encoded, tail_mean, wilson_interval


def test_wilson_interval_matches_the_formula_and_brackets_p():
    lo, hi = wilson_interval(2646, 2715)  # 97.5% of the held-out set
    p, n, z = 2646 / 2715, 2715, 1.96
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert np.isclose(lo, centre - half) and np.isclose(hi, centre + half)
    assert hi - lo < 0.013  # n = 2,715 resolves a 2% budget
    assert wilson_interval(100, 100)[1] == 1.0 and wilson_interval(0, 100)[0] == 0.0
    for k in (0, 1, 50, 99, 100):
        a, b = wilson_interval(k, 100)
        assert a <= k / 100 <= b


def test_tail_mean_is_the_worst_percent():
    cos = np.linspace(0.9, 1.0, 1000)
    assert np.isclose(tail_mean(cos), cos[:10].mean())
    assert tail_mean(np.array([0.5, 1.0])) == 0.5


def test_int8_budget_bounds_every_sentence_and_the_search_aims_higher():
    assert BUDGETS["int8"].min_cosine == 0.99 and BUDGETS["int8"].top1 == 0.98
    assert search_budget(BUDGETS["int8"]).min_cosine == 0.995
    # strict retrieval top-1 is in the INT8 budget, and the search aims half-way above it
    assert BUDGETS["int8"].top1_strict == 0.98 and search_budget(BUDGETS["int8"]).top1_strict == 0.99
    assert search_budget(Budget(mean_cosine=0.99)) == Budget(mean_cosine=0.99)


def test_serving_layout_mixes_lengths_and_batch_sizes(bundled_spec):
    texts = [("word " * (1 + (i * 7) % 60)).strip() for i in range(120)]
    sorted_, serving = Encoded(bundled_spec, texts), Encoded(bundled_spec, texts, layout="serving")
    sizes = [b.input_ids.shape[0] for b in serving.batches]
    assert sizes[: len(SERVING_BATCH_SIZES)] == list(SERVING_BATCH_SIZES)[: len(sizes)]
    assert sum(sizes) == 120 and sorted(serving.order.tolist()) == list(range(120))
    padded = lambda e: sum(b.input_ids.size for b in e.batches)  # noqa: E731
    assert padded(serving) > padded(sorted_)  # short sentences really sit beside long ones
