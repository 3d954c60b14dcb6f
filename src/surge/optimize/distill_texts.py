"""The text a student trains on: the shipped queries and their variants, or a user's query log.

Apart from distill.py so that the training loop reads on its own (and stays under ~500 lines).
"""

from __future__ import annotations

import json
from pathlib import Path

from surge.errors import ConfigError

AUGMENTED = 20_000  # query variants added to the default training text (augment_queries)


def default_texts() -> list[str]:
    """The shipped calibration queries and prose sentences, AUGMENTED variants of the queries, and the
    shipped distillation text (`surge.data.distill_texts`: voice-assistant skills' utterances and replies,
    open-domain chit-chat; built so that no held-out query, or near copy of one, is in it)."""
    from surge.data import calibration_queries, distill_texts, heldout_queries, load_sentences

    queries = calibration_queries()
    return queries + load_sentences() + augment_queries(queries, AUGMENTED, exclude=heldout_queries()) + distill_texts()


def augment_queries(queries: list[str], n: int, seed: int = 5, exclude: list[str] = ()) -> list[str]:
    """`n` distinct query-like variants of `queries`, none of them a query itself or in `exclude`
    (compared after `normalise`: case and punctuation aside): words dropped, words replaced by another query's, two queries
    spliced at their middles, or a short span. The teacher labels them, so they are free training
    text in the queries' own vocabulary and style; a student trained on the 1,304 shipped texts
    alone fits them (mean cosine 0.98) but not held-out queries (0.91). Measured on MiniLM 6 -> 3,
    300 s: held-out mean cosine 0.921 with them, 0.910 with 5,700 prose sentences and spans
    instead, 0.908 with neither after 900 s (docs/benchmarks/optimizer.md, Issue 21, session 3)."""
    import random

    rng = random.Random(seed)
    split = [q.split() for q in queries if q.split()]
    if not split:
        return []
    words = [w for q in split for w in q]
    from surge.data import normalise

    # compared as the shipped distillation text is: case and punctuation aside ("How are you" is "how are you?")
    seen = {normalise(q) for q in queries} | {normalise(t) for t in exclude}
    out: list[str] = []
    for _ in range(20 * n):  # bounded: a tiny or repetitive query set may have fewer variants
        if len(out) >= n:
            break
        a = rng.choice(split)
        r = rng.random()
        if r < 0.3 and len(a) > 2:
            a = [w for w in a if rng.random() > 0.2] or a
        elif r < 0.6:
            a = [rng.choice(words) if rng.random() < 0.2 else w for w in a]
        elif r < 0.85:
            b = rng.choice(split)
            a = a[: max(1, len(a) // 2)] + b[len(b) // 2:]
        else:
            k = rng.randint(1, min(5, len(a)))
            i = rng.randint(0, len(a) - k)
            a = a[i : i + k]
        text = " ".join(a)
        if normalise(text) not in seen:
            seen.add(normalise(text))
            out.append(text)
    return out


def read_texts(path: Path) -> list[str]:
    """One text per line, or JSON lines with a "text" (or "input") field: a query log."""
    texts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                row = json.loads(line)
                line = str(row.get("text") or row.get("input") or "")
            except json.JSONDecodeError:
                pass
        if line:
            texts.append(line)
    if not texts:
        raise ConfigError(f"{path}: no texts to train on")
    return texts
