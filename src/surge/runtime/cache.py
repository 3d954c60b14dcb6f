"""The hot-query cache, in front of tokenization (one per model version).

Keys are (options that change the output, normalized input). The model name
and version are the cache's namespace: each served version owns its own cache
(and its own Redis key prefix), so a version change can never serve a result
computed by another version.

Two local tiers:
- pinned: the hot set, never evicted by the recent tier's byte bound. Seeded
  with the top-K queries of a query log and/or learned online: a count-min
  frequency sketch (with TinyLFU-style aging) estimates each key's frequency
  and the K most frequent keys live here.
- recent: bounded in bytes, LRU order, with optional TinyLFU admission (a new
  entry must be more frequent than the LRU victim it would push out), which
  keeps one-off queries from flushing the cache.

Everything here runs on the event loop thread (no locks needed).
"""

from __future__ import annotations

import collections
import hashlib
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable

import numpy as np

from surge.config import CacheConfig
from surge.runtime.metrics import ServiceMetrics
from surge.types import EmbedOptions

Key = tuple  # (options key, normalized text or token-id bytes)


def key_hash(key: Key, prefix: bytes = b""):
    """SHA-256 over prefix, options and input: the key of a tier shared between processes
    (Redis: its hex digest; the front ends' shared-memory table: its first 16 bytes)."""
    opts, raw = key
    h = hashlib.sha256(prefix)
    h.update(repr(opts).encode())
    # the input's kind is hashed too: token ids (bytes) whose packing equals some text's UTF-8 would otherwise
    # share a key in the shared tiers with that text, and one caller would read the other's answer
    h.update(b"\0b" if isinstance(raw, bytes) else b"\0s")
    h.update(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass"))
    return h

_ENTRY_OVERHEAD = 160  # dict slot, tuple, entry object: roughly, in bytes


@dataclass(slots=True)
class CacheEntry:
    vector: np.ndarray  # float32 [dim], read-only, owns its memory
    tokens: int
    nbytes: int


def make_entry(key: Key, vector: np.ndarray, tokens: int) -> CacheEntry:
    v = np.array(vector, dtype=np.float32, copy=True)
    v.setflags(write=False)
    raw = key[1]
    return CacheEntry(v, int(tokens), v.nbytes + len(raw) + _ENTRY_OVERHEAD)


class FrequencySketch:
    """Count-min sketch (4 rows) with periodic halving, as in TinyLFU."""

    def __init__(self, width: int = 1 << 16, sample: int | None = None):
        w = 1
        while w < width:
            w <<= 1
        self.mask = w - 1
        self.rows = [[0] * w for _ in range(4)]
        self.sample = sample or 10 * w
        self.added = 0
        self.on_reset: Callable[[], None] | weakref.WeakMethod | None = None  # called after each halving

    def _slots(self, key: Hashable):
        h = hash(key)
        h2 = (h >> 17) | 1
        m = self.mask
        return ((h + i * h2) & m for i in range(4))

    def add(self, key: Hashable) -> int:
        est = None
        for row, i in zip(self.rows, self._slots(key)):
            c = row[i] + 1
            row[i] = c
            est = c if est is None or c < est else est
        self.added += 1
        if self.added >= self.sample:
            self.reset()
        return est

    def estimate(self, key: Hashable) -> int:
        return min(row[i] for row, i in zip(self.rows, self._slots(key)))

    def reset(self) -> None:
        """Halve every counter so that old popularity fades."""
        self.rows = [[c >> 1 for c in row] for row in self.rows]
        self.added //= 2
        if self.on_reset is not None:
            cb = self.on_reset() if isinstance(self.on_reset, weakref.WeakMethod) else self.on_reset
            if cb is not None:
                cb()


def text_normalizer(hf_tokenizer) -> Callable[[str], str]:
    """A key normalizer that maps two texts to one key only if they tokenize the same.

    For BERT-style tokenizers (BertNormalizer + whitespace pre-tokenizer) that
    is the tokenizer's own normalization followed by collapsing whitespace;
    for any other tokenizer the text is used as is (always safe).
    """
    norm = getattr(hf_tokenizer, "normalizer", None)
    pre = getattr(hf_tokenizer, "pre_tokenizer", None)
    bert_norm = type(norm).__name__ == "BertNormalizer"
    ws_pre = type(pre).__name__ in ("BertPreTokenizer", "Whitespace", "WhitespaceSplit")
    if bert_norm and ws_pre:
        normalize_str = norm.normalize_str

        def normalize(text: str) -> str:
            return " ".join(normalize_str(text).split())

        return normalize
    return lambda text: text


def read_query_log(path: Path, k: int, normalize: Callable[[str], str] = lambda t: t) -> list[str]:
    """The k most frequent (normalized) queries of a log: one query per line, or JSON lines whose objects
    carry the query as "text" (what `surge bench workload` writes and `surge bench run --query-log` reads);
    a line that is not such an object is a query as it stands."""
    counts: collections.Counter[str] = collections.Counter()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            q = line.rstrip("\n")
            if q.lstrip().startswith("{"):
                try:
                    rec = json.loads(q)
                except ValueError:
                    rec = None
                if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                    q = rec["text"]
            if q.strip():
                counts[normalize(q)] += 1
    return [q for q, _ in counts.most_common(k)]


class ResultCache:
    def __init__(self, cfg: CacheConfig, model: str = "model", version: str = "1",
                 metrics: ServiceMetrics | None = None, normalize: Callable[[str], str] | None = None,
                 default_options: tuple | None = None):
        """`default_options`: the options key the query log's queries are pinned under (default:
        EmbedOptions()'s, written once there)."""
        self.cfg = cfg
        self.model, self.version = model, version
        self.metrics = metrics
        self.normalize = normalize or (lambda t: t)
        self.max_bytes = cfg.max_bytes
        self.policy = cfg.recent_policy
        self.pinned: dict[Key, CacheEntry] = {}
        self.recent: collections.OrderedDict[Key, CacheEntry] = collections.OrderedDict()
        self.recent_bytes = 0
        self.pinned_bytes = 0
        # Keys allowed in the pinned tier: from the query log (fixed) and learned.
        self.static_hot: set[Key] = set()
        self.learned_hot: dict[Key, int] = {}  # key -> frequency estimate when last seen
        self._learned_min: tuple[Key, int] | None = None
        self.learn_slots = cfg.pinned_top_k
        est_entries = max(1024, cfg.max_bytes // 2048 + cfg.pinned_top_k)
        self.sketch = FrequencySketch(width=4 * est_entries)
        # weakly: the sketch is the cache's, and a bound method back would make a cycle that keeps a retired
        # build's cache alive until a full collection (runtime/gc_settle.py)
        self.sketch.on_reset = weakref.WeakMethod(self._aged)
        self.hits = collections.Counter()  # tier -> hits
        self.misses = 0
        self.evictions = 0
        self.rejected = 0
        if cfg.query_log is not None and cfg.pinned_top_k:
            self.pin_queries(read_query_log(Path(cfg.query_log), cfg.pinned_top_k, self.normalize),
                             EmbedOptions().key() if default_options is None else default_options)

    # ---- keys ----------------------------------------------------------------
    def text_key(self, text: str, options_key: tuple) -> Key:
        return (options_key, self.normalize(text))

    @staticmethod
    def ids_key(ids, options_key: tuple) -> Key:
        return (options_key, b"ids:" + np.asarray(ids, dtype=np.int64).tobytes())

    def pin_queries(self, queries: list[str], options_key: tuple) -> None:
        """Make these (already normalized) queries permanent members of the pinned tier."""
        self.static_hot = {(options_key, q) for q in queries[: self.cfg.pinned_top_k]}
        self.learn_slots = max(0, self.cfg.pinned_top_k - len(self.static_hot))

    # ---- lookups -------------------------------------------------------------
    def contains(self, key: Key) -> bool:
        """Whether a local tier holds `key` (counts nothing, changes nothing)."""
        return key in self.pinned or key in self.recent

    def peek(self, key: Key) -> CacheEntry | None:
        """The local tiers' entry for `key` or None, counting nothing and changing nothing: for a
        caller that may still decline the answer (and then counts it on the full path)."""
        e = self.pinned.get(key)
        return e if e is not None else self.recent.get(key)

    def get(self, key: Key, count_miss: bool = True) -> CacheEntry | None:
        """The entry for `key` or None. count_miss=False when a further tier
        (Redis) is asked next and the caller counts the final miss itself."""
        est = self.sketch.add(key)
        e = self.pinned.get(key)
        if e is not None:
            if key in self.learned_hot:
                self.learned_hot[key] = est
            self._hit("pinned")
            return e
        e = self.recent.get(key)
        if e is not None:
            self.recent.move_to_end(key)
            self._hit("recent")
            if self.learn_slots and self.cfg.learn_hot and self._wins_hot_slot(key, est):
                self._remove_recent(key)
                self._add_pinned(key, e)
            return e
        if count_miss:
            self.count_miss()
        return None

    def count_miss(self, n: int = 1) -> None:
        self.misses += n
        if self.metrics is not None:
            self.metrics.cache_misses.inc(n)

    def fill_from(self, tier: str, keys: list, miss: list[int], found: list, fill,
                  count_miss: bool = True) -> list[int]:
        """A further tier's answers for the positions `miss` (`found`: (vector, tokens) or None
        each): each hit is put in the local tiers, counted under `tier` and handed to
        `fill(position, vector, tokens)`; the rest are counted as misses unless `count_miss` is
        False (yet another tier is asked next). Returns the positions still missing."""
        still = []
        for i, f in zip(miss, found):
            if f is None:
                still.append(i)
                continue
            entry = self.put(keys[i], f[0], f[1])
            self._hit(tier)
            fill(i, entry.vector, entry.tokens)
        if count_miss:
            self.count_miss(len(still))
        return still

    def _hit(self, tier: str) -> None:
        self.hits[tier] += 1
        if self.metrics is not None:
            self.metrics.tier(tier)[0].inc()

    # ---- fills ---------------------------------------------------------------
    def put(self, key: Key, vector: np.ndarray, tokens: int) -> CacheEntry:
        if key in self.pinned:
            return self.pinned[key]
        entry = make_entry(key, vector, tokens)
        if key in self.static_hot:
            self._add_pinned(key, entry)
            return entry
        if self.learn_slots and self.cfg.learn_hot and self._wins_hot_slot(key, self.sketch.estimate(key)):
            self._remove_recent(key)
            self._add_pinned(key, entry)
            return entry
        self._add_recent(key, entry)
        return entry

    def _add_recent(self, key: Key, entry: CacheEntry) -> None:
        if key in self.recent:
            self._remove_recent(key)
        if entry.nbytes > self.max_bytes:
            self.rejected += 1
            return
        if self.policy == "tinylfu" and self.recent_bytes + entry.nbytes > self.max_bytes and self.recent:
            victim = next(iter(self.recent))
            if self.sketch.estimate(key) <= self.sketch.estimate(victim):
                self.rejected += 1  # not more popular than what it would push out
                return
        while self.recent and self.recent_bytes + entry.nbytes > self.max_bytes:
            _, old = self.recent.popitem(last=False)
            self.recent_bytes -= old.nbytes
            self.evictions += 1
            if self.metrics is not None:
                self.metrics.cache_evictions.inc()
        self.recent[key] = entry
        self.recent_bytes += entry.nbytes
        self._gauges("recent")

    def _remove_recent(self, key: Key) -> None:
        old = self.recent.pop(key, None)
        if old is not None:
            self.recent_bytes -= old.nbytes
            self._gauges("recent")

    def _add_pinned(self, key: Key, entry: CacheEntry) -> None:
        self.pinned[key] = entry
        self.pinned_bytes += entry.nbytes
        self._gauges("pinned")

    # ---- the learned hot set ---------------------------------------------------
    def _wins_hot_slot(self, key: Key, est: int) -> bool:
        """Whether `key` belongs to the learned top-K now (demoting the coldest if needed)."""
        if key in self.learned_hot or key in self.static_hot:
            return True
        if est < 2:
            return False  # one sighting says nothing about popularity
        if len(self.learned_hot) < self.learn_slots:
            self.learned_hot[key] = est
            self._learned_min = None
            return True
        if self._learned_min is None or est > self._learned_min[1]:
            cold = min(self.learned_hot.items(), key=lambda kv: kv[1])
            self._learned_min = cold
            if est <= cold[1]:
                return False
            self._demote(cold[0])
            self.learned_hot[key] = est
            self._learned_min = None
            return True
        return False

    def _demote(self, key: Key) -> None:
        self.learned_hot.pop(key, None)
        e = self.pinned.pop(key, None)
        if e is not None:
            self.pinned_bytes -= e.nbytes
            self._gauges("pinned")
            self._add_recent(key, e)

    def _aged(self) -> None:
        for k in self.learned_hot:
            self.learned_hot[k] >>= 1
        self._learned_min = None

    # ---- accounting ------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.recent_bytes + self.pinned_bytes

    def publish(self) -> None:
        """This cache's build is routed now: its state is what the gauges show, at once (empty after a
        reload) and from now on (ServiceMetrics.claim_cache)."""
        if self.metrics is None:
            return
        self.metrics.claim_cache(self)
        self._gauges("recent")
        self._gauges("pinned")

    def _gauges(self, tier: str) -> None:
        if self.metrics is None or not self.metrics.owns_cache(self):
            return
        _, g_bytes, g_entries = self.metrics.tier(tier)
        if tier == "recent":
            g_bytes.set(self.recent_bytes)
            g_entries.set(len(self.recent))
        else:
            g_bytes.set(self.pinned_bytes)
            g_entries.set(len(self.pinned))

    def stats(self) -> dict:
        hits = sum(self.hits.values())
        total = hits + self.misses
        return {
            "hits": dict(self.hits), "misses": self.misses, "hit_ratio": hits / total if total else 0.0,
            "evictions": self.evictions, "rejected": self.rejected,
            "recent_entries": len(self.recent), "recent_bytes": self.recent_bytes,
            "pinned_entries": len(self.pinned), "pinned_bytes": self.pinned_bytes,
        }
