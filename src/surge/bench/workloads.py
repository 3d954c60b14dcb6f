"""Benchmark workloads: distinct assistant-style queries, Zipf popularity, query logs.

A workload is a pool of distinct queries plus a popularity over them. Rank r
(1-based) is drawn with probability proportional to 1 / r**s. By default s is
solved so that the `HOT_K` = 500 hottest queries carry `HOT_SHARE` = 30 % of the
traffic, which is what hot-query caches in front of assistants report; pass
`zipf_s` to choose another skew. Everything is driven by explicit seeds, so two
runs with the same arguments send the same queries in the same order.

Query log format (replayable, written by `write_query_log`): JSON lines,
one request per line, `{"text": "...", "t": 0.0123}`; `t` (seconds from the
start, optional) lets a replay reproduce the original arrival times. Plain
text, one query per line (what the cache's pinned tier is seeded from), is
written for a .txt path and read as well.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from surge.bench import templates as T

DEFAULT_POOL = 6000
HOT_K = 500
HOT_SHARE = 0.30
_SLOT = re.compile(r"\{([a-z_]+?)(\d?)\}")


def generate_queries(n: int = DEFAULT_POOL, seed: int = 0) -> list[str]:
    """`n` distinct queries, in a seed-determined random order (which becomes popularity rank)."""
    rng = np.random.default_rng(seed)
    families = {"short": T.SHORT, "medium": T.MEDIUM, "long": T.LONG}
    names = list(T.FAMILY_WEIGHTS)
    probs = np.array([T.FAMILY_WEIGHTS[k] for k in names])
    probs = probs / probs.sum()
    seen: dict[str, None] = {}
    attempts = 0
    while len(seen) < n:
        attempts += 1
        if attempts > 50 * n + 10_000:
            raise ValueError(f"the templates cannot make {n} distinct queries (got {len(seen)})")
        family = families[names[rng.choice(len(names), p=probs)]]
        text = _fill(family[rng.integers(len(family))], rng)
        text = T.PREFIXES[rng.integers(len(T.PREFIXES))] + text + T.SUFFIXES[rng.integers(len(T.SUFFIXES))]
        seen.setdefault(text, None)
    return list(seen)


def _fill(template: str, rng: np.random.Generator) -> str:
    chosen: dict[str, str] = {}

    def value(m: re.Match) -> str:
        base, idx = m.group(1), m.group(2)
        values = T.SLOTS[base]
        pick = values[rng.integers(len(values))]
        # {city2} differs from {city}: "how far is paris from paris" is no query.
        while idx and pick == chosen.get(base) and len(values) > 1:
            pick = values[rng.integers(len(values))]
        chosen.setdefault(base, pick)
        return pick

    return _SLOT.sub(value, template)


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Probabilities of ranks 1..n under Zipf(s), float64, summing to 1."""
    w = np.arange(1, n + 1, dtype=np.float64) ** -float(s)
    return w / w.sum()


def top_share(n: int, s: float, k: int = HOT_K) -> float:
    return float(zipf_weights(n, s)[: min(k, n)].sum())


def exponent_for_top_share(n: int, k: int = HOT_K, share: float = HOT_SHARE) -> float:
    """The Zipf exponent under which the k most popular of n queries get `share` of draws."""
    if k >= n:
        return 0.0
    lo, hi = 0.0, 4.0  # top_share grows with s: bisect
    for _ in range(60):
        mid = (lo + hi) / 2
        if top_share(n, mid, k) < share:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class Workload:
    """What to send: a pool with a popularity (sampled), or a fixed sequence (replayed)."""

    queries: list[str]
    weights: np.ndarray | None = None  # None: replay `queries` in order, cycling
    times: np.ndarray | None = None  # replay arrival offsets (seconds), if the log had them
    zipf_s: float | None = None
    seed: int = 0
    source: str = "templates"
    meta: dict = field(default_factory=dict)

    def stream(self, seed: int | None = None, chunk: int = 4096) -> Iterator[str]:
        """An endless iterator of queries (same seed, same sequence)."""
        if self.weights is None:
            while True:
                yield from self.queries
        rng = np.random.default_rng(self.seed if seed is None else seed)
        cdf = np.cumsum(self.weights)
        cdf[-1] = 1.0
        while True:
            for i in np.searchsorted(cdf, rng.random(chunk), side="right"):
                yield self.queries[int(i)]

    def sample(self, n: int, seed: int | None = None) -> list[str]:
        it = self.stream(seed)
        return [next(it) for _ in range(n)]

    def describe(self) -> dict:
        lengths = np.array([len(q.split()) for q in self.queries])
        out = {"source": self.source, "distinct_queries": len(self.queries), "seed": self.seed,
               "words_p50": float(np.median(lengths)), "words_p90": float(np.percentile(lengths, 90)),
               "words_max": int(lengths.max()), **self.meta}
        if self.weights is not None:
            out["zipf_s"] = self.zipf_s
            out[f"top{HOT_K}_share"] = float(np.sort(self.weights)[::-1][:HOT_K].sum())
        return out


def make_workload(n_queries: int = DEFAULT_POOL, zipf_s: float | None = None, seed: int = 0) -> Workload:
    """Template queries with Zipf popularity (default skew: top 500 = 30 % of traffic)."""
    queries = generate_queries(n_queries, seed)
    s = exponent_for_top_share(n_queries) if zipf_s is None else float(zipf_s)
    return Workload(queries, zipf_weights(n_queries, s), zipf_s=s, seed=seed)


def uniform_workload(queries: list[str], seed: int = 0) -> Workload:
    return Workload(list(queries), np.full(len(queries), 1.0 / len(queries)), zipf_s=0.0, seed=seed,
                    source="list")


def write_query_log(path: str | Path, texts: list[str], times: np.ndarray | list[float] | None = None,
                    fmt: str | None = None) -> Path:
    """JSON lines (`fmt="jsonl"`, the default) or plain text, one query per line (`fmt="text"`, the
    default for a .txt path); `surge serve --cache-query-log` reads either to seed its pinned tier."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = fmt or ("text" if path.suffix == ".txt" else "jsonl")
    if fmt == "text":
        if any("\n" in t for t in texts):
            raise ValueError("a plain-text query log cannot hold queries with newlines")
        path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
        return path
    with path.open("w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            rec = {"text": text}
            if times is not None:
                rec["t"] = round(float(times[i]), 6)
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def read_query_log(path: str | Path) -> Workload:
    """Replay a log written by `write_query_log` (JSON lines) or a one-query-per-line text file."""
    path = Path(path)
    texts: list[str] = []
    times: list[float] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                rec = json.loads(line)
                texts.append(str(rec["text"]))
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{n}: not a query-log record ({exc})") from None
            if "t" in rec:
                times.append(float(rec["t"]))
        else:
            texts.append(line.strip())
    if not texts:
        raise ValueError(f"{path}: no queries")
    has_times = len(times) == len(texts)
    if has_times and np.any(np.diff(times) < 0):
        raise ValueError(f"{path}: times must not decrease")
    return Workload(texts, None, np.asarray(times) if has_times else None, source=str(path))


def poisson_offsets(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival offsets (seconds) of a Poisson process with `rate` per second."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))
