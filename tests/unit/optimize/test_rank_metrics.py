"""A reranker's gate metrics beyond top-1 and NDCG (optimize/task_metrics.py): the weighted Kendall tau
of each query's ranking and how far a served relevance score moves."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import kendalltau

from surge.engines.heads import sigmoid
from surge.optimize.task_metrics import rank_tau, score_agreement
from surge.optimize.validate import BUDGETS, SetMetrics, check

REF = np.array([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])


def test_rank_tau_is_one_for_the_same_ranking_and_minus_one_reversed():
    assert rank_tau(REF, REF) == pytest.approx(1.0)
    assert rank_tau(REF, 2 * REF + 5) == pytest.approx(1.0)  # a ranking, not a scale
    assert rank_tau(REF, -REF) == pytest.approx(-1.0)


def test_rank_tau_weighs_a_swap_at_the_top_above_one_at_the_bottom():
    top, bottom = REF.copy(), REF.copy()
    top[0, [0, 1]] = top[0, [1, 0]]
    bottom[0, [4, 5]] = bottom[0, [5, 4]]
    # plain Kendall tau counts both as one discordant pair of 15
    assert kendalltau(REF[0], top[0])[0] == pytest.approx(kendalltau(REF[0], bottom[0])[0])
    assert rank_tau(REF, top) < rank_tau(REF, bottom) < 1.0


def test_rank_tau_of_a_constant_or_nan_candidate_is_zero():
    assert rank_tau(REF, np.zeros_like(REF)) == 0.0
    assert rank_tau(REF, np.full_like(REF, np.nan)) == 0.0
    assert rank_tau(np.zeros_like(REF), REF) == 1.0  # a reference that ranks nothing: nothing to lose


def test_score_agreement_is_one_minus_the_largest_served_score_change():
    cand = REF.copy()
    cand[0, 2] += 0.5
    want = 1.0 - abs(sigmoid(cand[0, 2]) - sigmoid(REF[0, 2]))
    assert score_agreement(REF, cand) == pytest.approx(want)
    assert score_agreement(REF, REF) == 1.0
    assert score_agreement(REF, np.full_like(REF, np.nan)) == 0.0


def _rerank_set(tau: float, score: float, long: bool = False) -> SetMetrics:
    return SetMetrics(8, 1.0, 1.0, 0.0, None, None, rank_top1=1.0, ndcg10=1.0, rank_tau=tau, rank_score=score,
                      long_inputs=long)


@pytest.mark.parametrize("budget", ["fp32", "fp16", "bf16", "int8"])
def test_every_precision_gates_a_reranker_on_tau_and_score(budget):
    b = BUDGETS[budget]
    assert 0 < b.rank_tau < 1 and 0 < b.rank_score < 1
    assert check(b, {"long": _rerank_set(1.0, 1.0, long=True)}).passed
    assert check(b, {"long": _rerank_set(b.rank_tau - 0.01, 1.0, long=True)}).failures == [
        f"long: rank_tau {b.rank_tau - 0.01:.4f} < {b.rank_tau}"]
    assert not check(b, {"heldout": _rerank_set(1.0, b.rank_score - 0.01)}).passed
    assert not check(b, {"heldout": _rerank_set(float("nan"), 1.0)}).passed
