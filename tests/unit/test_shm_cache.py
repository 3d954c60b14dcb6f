"""runtime/shm_cache: processes racing on one small shared table (constant evictions, the same buckets
written by two processes while two others read) never get a vector other than the one written for
that key; keys of other models, versions and builds never meet."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time

import numpy as np

from surge.runtime.shm_cache import ShmTable, ShmTier

DIM = 96


def _digest(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def _vector(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(DIM).astype(np.float32)


def _writer(path: str, seed: int, seconds: float, q) -> None:
    t = ShmTable(path, DIM, 8 * 2 * t_rec())
    rng = np.random.default_rng(seed)
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        i = int(rng.integers(0, 64))
        t.put(_digest(i), _vector(i), i + 1)
        n += 1
    q.put(("w", n, 0, 0))


def _reader(path: str, seed: int, seconds: float, q) -> None:
    t = ShmTable(path, DIM, 8 * 2 * t_rec())
    rng = np.random.default_rng(seed)
    hits = wrong = reads = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i = int(rng.integers(0, 64))
        got = t.get(_digest(i))
        reads += 1
        if got is not None:
            hits += 1
            vec, tokens = got
            wrong += int(tokens != i + 1 or not np.array_equal(vec, _vector(i)))
    q.put(("r", reads, hits, wrong))


def t_rec() -> int:
    from surge.runtime.shm_cache import _dtype

    return _dtype(DIM).itemsize


def test_racing_writers_and_readers_get_only_what_was_written(tmp_path):
    path = str(tmp_path / "cache.shm")
    ShmTable(path, DIM, 8 * 2 * t_rec())  # 8 buckets of 2 ways for 64 keys: evictions all the time
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, s, 3.0, q)) for s in (1, 2)]
    procs += [ctx.Process(target=_reader, args=(path, s, 3.0, q)) for s in (3, 4)]
    for p in procs:
        p.start()
    out = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    writes = sum(n for kind, n, _, _ in out if kind == "w")
    reads = sum(n for kind, n, _, _ in out if kind == "r")
    hits = sum(h for kind, _, h, _ in out if kind == "r")
    wrong = sum(w for kind, _, _, w in out if kind == "r")
    assert writes > 100 and reads > 100  # seconds of racing, whatever the machine's speed
    assert 0 < hits < reads  # a bounded table under churn: some hits, some misses
    assert wrong == 0


def test_a_bucket_keeps_two_ways_and_replaces_the_older(tmp_path):
    t = ShmTable(tmp_path / "c.shm", DIM, 2 * t_rec())  # one bucket
    assert t.buckets == 1
    for i in (1, 2):
        t.put(_digest(i), _vector(i), i)
    assert t.get(_digest(1))[1] == 1 and t.get(_digest(2))[1] == 2
    t.put(_digest(3), _vector(3), 3)  # replaces the older (1)
    assert t.get(_digest(1)) is None and t.get(_digest(2))[1] == 2
    np.testing.assert_array_equal(t.get(_digest(3))[0], _vector(3))


def test_tiers_of_other_models_versions_and_builds_never_share_an_entry(tmp_path):
    table = ShmTable(tmp_path / "c.shm", DIM, 64 * 2 * t_rec())
    key = ((None, True, None), "the same text")
    tiers = [ShmTier(table, "a", "1", "x"), ShmTier(table, "b", "1", "x"), ShmTier(table, "a", "2", "x"),
             ShmTier(table, "a", "1", "y")]
    for n, tier in enumerate(tiers):
        tier.put(key, _vector(100 + n), n + 1)
    for n, tier in enumerate(tiers):
        vec, tokens = tier.get(key)
        assert tokens == n + 1 and np.array_equal(vec, _vector(100 + n))
    assert ShmTier(table, "a", "1", "x").get((("other",), "the same text")) is None
