"""The gate's metrics for task models (classify, rerank, token-classify) that need no session: label
margins, chance-corrected label agreement (Cohen's kappa), a reranker's (query, document) pairs and its
ranking agreement. validate.py applies them."""

from __future__ import annotations

import numpy as np

from surge.errors import ConfigError
from surge.models.hf import ModelSpec

RERANK_QUERIES, RERANK_DOCS = 8, 20


def label_margin(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Per row: the candidate's logit of the reference's label minus its best other logit
    (negative: the label changed; small: it nearly did)."""
    ref, cand = np.nan_to_num(ref, nan=-np.inf), np.nan_to_num(cand, nan=-np.inf)
    label = ref.argmax(1)
    own = np.take_along_axis(cand, label[:, None], 1)[:, 0]
    other = cand.copy()
    other[np.arange(len(cand)), label] = -np.inf
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(own - other.max(1), nan=-np.inf)


def cohen_kappa(ref: np.ndarray, cand: np.ndarray) -> float:
    """Cohen's kappa of two label sequences: agreement beyond what two labellers with these label
    frequencies would reach by chance. Why the gate needs it beside plain agreement: a candidate that
    always answers the commonest label agrees on every input that has it (a tagger that says "O"
    everywhere agrees on 97% of tokens when 97% are "O"), and its kappa is 0. Both sequences constant
    and equal: 1.0 (nothing told apart, nothing lost)."""
    ref, cand = np.asarray(ref).ravel(), np.asarray(cand).ravel()
    if ref.size == 0:
        return 1.0
    labels, codes = np.unique(np.concatenate([ref, cand]), return_inverse=True)
    r, c = codes[:ref.size], codes[ref.size:]
    observed = float((r == c).mean())
    chance = float((np.bincount(r, minlength=len(labels)) / r.size) @ (np.bincount(c, minlength=len(labels)) / c.size))
    if chance >= 1.0:
        return 1.0
    return (observed - chance) / (1.0 - chance)


def rerank_pairs(texts: list[str]) -> list[tuple[str, str]]:
    """8 queries x 20 documents out of a sentence set (query-major order)."""
    queries, docs = texts[:RERANK_QUERIES], texts[RERANK_QUERIES:RERANK_QUERIES + RERANK_DOCS]
    if len(docs) < RERANK_DOCS:
        raise ConfigError(f"a reranker's gate needs at least {RERANK_QUERIES + RERANK_DOCS} sentences per set, "
                          f"this one has {len(texts)} (raise --max-sentences)", param="max-sentences")
    return [(q, d) for q in queries for d in docs]


def check_set_sizes(spec: ModelSpec, calibration: list[str], heldout: list[str]) -> None:
    """What the Evaluator would refuse, refused before the export and the reference runs."""
    if not calibration or not heldout:
        raise ConfigError("the gate needs calibration and held-out sentences (--max-sentences >= 1)",
                          param="max-sentences")
    if spec.task == "rerank":
        rerank_pairs(calibration), rerank_pairs(heldout)


def ranking_agreement(ref: np.ndarray, cand: np.ndarray, k: int = 10, tie: float = 1e-3) -> tuple[float, float]:
    """(top-1 agreement, mean NDCG@k) of candidate scores [Q, D] against reference scores [Q, D]."""
    top1, ndcg = [], []
    for r, c in zip(ref.astype(np.float64), cand.astype(np.float64)):
        spread = max(float(r.max() - r.min()), 1e-12)
        top1.append(bool(r[int(np.argmax(c))] >= r.max() - tie * spread))
        ranks = np.empty(len(r), dtype=np.int64)
        ranks[np.argsort(-r, kind="stable")] = np.arange(len(r))
        gain = np.clip(k - ranks, 0, None).astype(np.float64)  # graded by the reference ranking
        kk = min(k, len(r))
        disc = 1.0 / np.log2(np.arange(2, kk + 2))
        dcg = (gain[np.argsort(-c, kind="stable")[:kk]] * disc).sum()
        idcg = (np.sort(gain)[::-1][:kk] * disc).sum()
        ndcg.append(dcg / idcg)
    return float(np.mean(top1)), float(np.mean(ndcg))


def rank_tau(ref: np.ndarray, cand: np.ndarray) -> float:
    """Mean over queries of the weighted Kendall tau (scipy.stats.weightedtau, hyperbolic weights) of the
    candidate's document scores [Q, D] against the reference's, the weights following the reference's
    ranking: a swap among its best documents, the ones a client keeps (top_n), costs more than one among
    the documents it drops, where plain Kendall tau counts both the same and top-1 / NDCG@10 see neither
    past the first few. 1: the same order; -1: reversed. A query whose candidate scores are constant or
    not finite ranks nothing: 0; one whose reference scores are all equal has nothing to lose: 1."""
    from scipy.stats import weightedtau

    taus = []
    for r, c in zip(ref.astype(np.float64), cand.astype(np.float64)):
        if np.ptp(r) == 0.0:
            taus.append(1.0)
            continue
        if not np.all(np.isfinite(c)) or np.ptp(c) == 0.0:
            taus.append(0.0)
            continue
        tau = weightedtau(r, c, rank=None)[0]  # rank=None: ranks by `r`, the reference's order
        taus.append(float(tau) if np.isfinite(tau) else 0.0)
    return float(np.mean(taus))


def score_agreement(ref: np.ndarray, cand: np.ndarray) -> float:
    """1 - the largest change of a served relevance score (the sigmoid of the logit, as /v1/rerank and
    sentence-transformers' CrossEncoder report it) over all pairs: a client that keeps documents above a
    score threshold sees a shifted or rescaled score even where the ranking holds. Non-finite: 0."""
    from surge.engines.heads import sigmoid

    with np.errstate(invalid="ignore"):
        change = np.abs(sigmoid(cand) - sigmoid(ref))
    return float(1.0 - change.max()) if np.all(np.isfinite(change)) else 0.0
