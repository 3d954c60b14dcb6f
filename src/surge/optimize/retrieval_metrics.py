"""The embedding gate's retrieval statistics: cosine per row, nearest-neighbour retrieval agreement with
ties, the Wilson interval of a rate and the mean of the worst tail (optimize/validate.py gates on them)."""

from __future__ import annotations


import numpy as np


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = (a * b).sum(1) / den
    return np.nan_to_num(cos, nan=-1.0)  # a NaN embedding counts as the worst possible


# Sentences whose two nearest neighbours the FP32 model itself scores within
# this cosine of each other are ties: either answer is a correct retrieval.
# (On the bundled sentences about 10% of queries have a gap under 0.01, so a
# strict top-1 agreement measures those ties more than the model.)
TIE_TOLERANCE = 0.01


def similarities(emb: np.ndarray) -> np.ndarray:
    x = emb.astype(np.float64)
    x = x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
    sims = np.nan_to_num(x @ x.T, nan=-2.0)
    np.fill_diagonal(sims, -np.inf)
    return sims


def nearest_neighbours(emb: np.ndarray) -> np.ndarray:
    return similarities(emb).argmax(1)


# Retrieval as the issue measures it: queries over documents that are not themselves queries. The set is
# cut into RETRIEVAL_FOLDS contiguous parts; each part in turn is the queries, the rest the documents, so
# every sentence is a query once (n queries: the interval is as tight as the set allows).
RETRIEVAL_FOLDS = 3


def retrieval_agreement(ref: np.ndarray, cand: np.ndarray, tolerance: float = 0.0,
                        folds: int = RETRIEVAL_FOLDS) -> np.ndarray:
    """Per query (every row, once): does the candidate's best document score within `tolerance` of the
    reference's best (0: is it the reference's best)? Documents: the other folds' rows."""
    n = len(ref)
    if n < 2 * folds:  # too few to split: every other sentence is a document
        sims = similarities(ref)
        return sims[np.arange(n), nearest_neighbours(cand)] >= sims.max(1) - tolerance if tolerance else \
            nearest_neighbours(cand) == nearest_neighbours(ref)

    def unit(x):
        x = x.astype(np.float64)
        return np.nan_to_num(x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None), nan=0.0)

    r, c = unit(ref), unit(cand)
    broken = ~np.isfinite(cand).all(1)
    c[broken] = 0.0  # a NaN / inf embedding is retrieved by nothing
    hits = np.zeros(n, bool)
    for q in np.array_split(np.arange(n), folds):
        docs = np.setdiff1d(np.arange(n), q)
        rs, cs = r[q] @ r[docs].T, c[q] @ c[docs].T
        pick = cs.argmax(1)
        hits[q] = (pick == rs.argmax(1)) if tolerance <= 0 else rs[np.arange(len(q)), pick] >= rs.max(1) - tolerance
    hits[broken] = False  # ... and retrieves nothing
    return hits


def top1_agreement(ref: np.ndarray, cand: np.ndarray, tolerance: float = 0.0) -> float:
    ref_sims = similarities(ref)
    best = ref_sims.max(1)
    chosen = ref_sims[np.arange(len(ref)), nearest_neighbours(cand)]
    return float((chosen >= best - tolerance).mean())


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (well behaved near 0 and 1, unlike the normal one)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    # At p = 0 or 1 the bound is exactly 0 or 1; rounding must not put p outside its interval.
    return (0.0 if successes <= 0 else float(min(lo, p)), 1.0 if successes >= n else float(max(hi, p)))


def tail_mean(cos: np.ndarray, fraction: float = 0.01) -> float:
    k = max(1, int(np.ceil(len(cos) * fraction)))
    return float(np.sort(cos)[:k].mean())
