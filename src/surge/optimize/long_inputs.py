"""The gate's long inputs: texts past the 128 tokens the calibration and held-out sets are cut at.

The shipped sentences are short queries, and the sets are tokenized at 128 tokens, while a served
request goes up to the model's max length (256 / 512). A candidate whose error shows only on longer
inputs (position embeddings past 128 rounded or broken, attention scores that overflow FP16 over
long rows) would be promoted without one such input measured. So the gate adds a small set of
texts built by joining held-out sentences, with lengths spread evenly from just past 128 tokens up
to the max length, tokenized at the max length. Small, because it is the costly part of the gate on
a 2-core machine (attention grows with the square of the length): LONG_SHARE of the held-out
sentences, between LONG_MIN and LONG_MAX texts.

A reranker scores (query, document) pairs, and its traffic carries long documents: its long set is
pairs (long_rerank_pairs), the same RERANK_QUERIES short queries as its other sets, each with the
same LONG_RERANK_DOCS joined-sentence documents, the pairs' lengths spread from just past 128 tokens
up to the max length, so that each query ranks documents of every length as the gate's other sets do.
"""

from __future__ import annotations

import numpy as np

from surge.models.hf import ModelSpec
from surge.optimize.task_metrics import RERANK_QUERIES

SHORT = 128  # what the calibration / held-out sets are tokenized at (validate.encode_texts' default)
LONG_SHARE, LONG_MIN, LONG_MAX = 1 / 64, 8, 32
# Documents per query of a reranker's long set: 8 x 8 pairs, twice LONG_MIN texts (one query ranking
# 8 documents is the least that NDCG and a rank correlation say much about).
LONG_RERANK_DOCS = 8


def _tokenizer(spec: ModelSpec):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(spec.tokenizer_file))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _joined(tok, sentences: list[str], targets, seed: int) -> list[str]:
    """Per target, held-out sentences joined until the text has at least that many tokens (no special
    tokens), taken in one seeded order; a small set is gone through again, so every text reaches its length."""
    lengths = [len(e.ids) for e in tok.encode_batch(list(sentences), add_special_tokens=False)]
    if max(lengths) == 0:
        return []
    order = np.random.default_rng(seed).permutation(len(sentences))
    out, k = [], 0
    for target in targets:
        parts, n = [], 0
        while n < target:
            i = int(order[k % len(order)])
            parts.append(sentences[i])
            n += lengths[i]
            k += 1
        out.append(" ".join(parts))
    return out


def long_texts(spec: ModelSpec, sentences: list[str], count: int | None = None, seed: int = 0) -> list[str]:
    """`count` texts (default: LONG_SHARE of `sentences`, within [LONG_MIN, LONG_MAX]) of joined
    sentences, the i-th reaching at least its target length in tokens (special tokens included), the
    targets spread evenly over (SHORT, spec.max_length]; [] when the model serves nothing past SHORT."""
    if spec.max_length <= SHORT or not sentences:
        return []
    if count is None:
        count = int(np.clip(round(len(sentences) * LONG_SHARE), LONG_MIN, LONG_MAX))
    tok = _tokenizer(spec)
    special = len(tok.encode("", add_special_tokens=True).ids)
    targets = np.linspace(SHORT + 1, spec.max_length, count).round().astype(int)
    return _joined(tok, sentences, targets - special, seed)


def long_rerank_pairs(spec: ModelSpec, sentences: list[str], docs: int = LONG_RERANK_DOCS,
                      seed: int = 0) -> list[tuple[str, str]]:
    """A reranker's long set, query-major as task_metrics.rerank_pairs lays pairs out: the first
    RERANK_QUERIES sentences as queries, each paired with the same `docs` documents joined out of the
    other sentences; the j-th pair of the shortest query reaches the j-th of `docs` lengths spread
    evenly over (SHORT, spec.max_length] (special tokens included), a longer query's pair more (the
    longest pairs are truncated at the max length, as served). [] when the model serves nothing past
    SHORT or there are no sentences besides the queries."""
    queries, rest = sentences[:RERANK_QUERIES], sentences[RERANK_QUERIES:]
    if spec.max_length <= SHORT or not rest:
        return []
    tok = _tokenizer(spec)
    special = len(tok.encode("", "", add_special_tokens=True).ids)  # [CLS] q [SEP] d [SEP]: 3 for BERT
    shortest = min(len(e.ids) for e in tok.encode_batch(list(queries), add_special_tokens=False))
    targets = np.linspace(SHORT + 1, spec.max_length, docs).round().astype(int) - special - shortest
    documents = _joined(tok, rest, np.maximum(targets, 1), seed)
    return [(q, d) for q in queries for d in documents] if documents else []
