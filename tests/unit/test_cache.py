"""The hot-query cache: exact hits, byte bound, pinned tier, versions, Redis."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from surge.config import BatchingConfig, CacheConfig
from surge.runtime.cache import ResultCache, text_normalizer
from surge.runtime.service import ModelService
from surge.types import EmbedOptions
from tests.redis_server import redis_server  # noqa: F401  (fixture)

OPTS = EmbedOptions().key()


def _service(worker, version="1", **cache_kw) -> ModelService:
    svc = ModelService(worker.spec.name, version, worker, batching=BatchingConfig(max_queue_delay_ms=1),
                       cache=CacheConfig(**cache_kw))
    svc.mark_ready()
    return svc


async def _shutdown(svc: ModelService) -> None:
    # The worker (engines) is shared by the module; free everything else.
    await svc.admission.drain()
    await svc.batcher.close()
    if svc.redis is not None:
        await svc.redis.close()


def test_hits_return_exactly_what_the_miss_computed(bundled_worker, sentences, reference_embed):
    texts = random.Random(3).sample(sentences, 24)

    async def main():
        svc = _service(bundled_worker)
        first = await svc.embed(texts=texts)
        second = await svc.embed(texts=texts[::-1])
        # Texts that differ only in case and spacing tokenize the same: one key.
        third = await svc.embed(texts=["  " + texts[0].upper().replace(" ", "   ")])
        dims = await svc.embed(texts=texts[:3], options=EmbedOptions(dimensions=64))
        stats = svc.cache.stats()
        await _shutdown(svc)
        return first, second, third, dims, stats

    first, second, third, dims, stats = asyncio.run(main())
    assert first.cached == [False] * 24 and second.cached == [True] * 24
    np.testing.assert_array_equal(second.vectors, first.vectors[::-1])
    assert second.prompt_tokens == first.prompt_tokens
    assert third.cached == [True]
    np.testing.assert_array_equal(third.vectors[0], first.vectors[0])
    # Options that change the output are part of the key.
    assert dims.cached == [False] * 3 and dims.vectors.shape == (3, 64)
    assert stats["hits"]["recent"] == 25 and stats["misses"] == 27
    # And what was computed is right (the PyTorch FP32 reference).
    ref = reference_embed(texts)
    assert np.abs(first.vectors - ref).max() < 1e-4


def test_normalizer_only_merges_inputs_that_tokenize_the_same(bundled_worker, sentences):
    norm = text_normalizer(bundled_worker.tokenizer.backend)
    tok = bundled_worker.tokenizer
    rng = random.Random(5)
    for s in rng.sample(sentences, 50):
        variant = "\t" + s.upper().replace(" ", " \n ") + "  "
        assert norm(variant) == norm(s)
        a, b = tok.encode([s, variant])
        assert a.ids.tolist() == b.ids.tolist()
    assert norm("apple pie") != norm("apple pies")


def test_recent_tier_holds_its_byte_bound_and_counts_evictions(sentences):
    vec = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    cache = ResultCache(CacheConfig(max_bytes=40_000, recent_policy="lru"))
    for i, s in enumerate(sentences):
        cache.put(cache.text_key(f"{i} {s}", OPTS), vec * i, 10)
        assert cache.recent_bytes <= 40_000
    assert cache.evictions > 0 and len(cache.recent) < len(sentences)
    # LRU: the newest entries are the ones kept.
    last = cache.get(cache.text_key(f"{len(sentences) - 1} {sentences[-1]}", OPTS))
    np.testing.assert_array_equal(last.vector, vec * (len(sentences) - 1))
    assert cache.get(cache.text_key(f"0 {sentences[0]}", OPTS)) is None


def test_pinned_queries_from_a_log_are_never_evicted(tmp_path, sentences):
    hot = sentences[:5]
    log = tmp_path / "queries.log"
    rng = random.Random(0)
    lines = [q for q in hot for _ in range(20)] + rng.sample(sentences[5:], 100)
    rng.shuffle(lines)
    log.write_text("\n".join(lines) + "\n")
    cache = ResultCache(CacheConfig(max_bytes=20_000, pinned_top_k=5, query_log=log, learn_hot=False,
                                     recent_policy="lru"))
    vecs = np.random.default_rng(1).standard_normal((len(sentences), 384)).astype(np.float32)
    for i, q in enumerate(hot):
        cache.put(cache.text_key(q, OPTS), vecs[i], 7)
    for i, s in enumerate(sentences[5:], start=5):  # flood the recent tier many times over
        cache.put(cache.text_key(s, OPTS), vecs[i], 7)
    assert cache.evictions > 0
    for i, q in enumerate(hot):
        e = cache.get(cache.text_key(q, OPTS))
        assert e is not None
        np.testing.assert_array_equal(e.vector, vecs[i])
    assert cache.hits["pinned"] == 5 and len(cache.pinned) == 5


def test_query_log_of_surge_bench_workload_seeds_the_pinned_tier(tmp_path, sentences):
    """`surge bench workload q.log` writes JSON lines ({"text", "t"}); `--cache-query-log q.log` read each
    line as a query, so it pinned the JSON records themselves and no real query ever hit them."""
    from surge.bench.workloads import write_query_log
    from surge.runtime.cache import read_query_log

    hot = sentences[:3]
    texts = [q for q in hot for _ in range(5)] + sentences[3:6] + ["{not json, a query}"]
    log = write_query_log(tmp_path / "q.log", texts, times=list(range(len(texts))))
    assert log.read_text().startswith('{"text": ')
    assert read_query_log(log, 3) == hot
    assert "{not json, a query}" in read_query_log(log, 10)  # a plain line that looks like JSON stays a query
    assert read_query_log(write_query_log(tmp_path / "q.txt", texts), 3) == hot  # one query per line, as before


def test_hot_set_is_learned_online_and_survives_a_scan(sentences):
    cache = ResultCache(CacheConfig(max_bytes=30_000, pinned_top_k=3, recent_policy="lru"))
    vec = np.ones(384, np.float32)
    hot = [cache.text_key(q, OPTS) for q in sentences[:3]]
    for _ in range(5):
        for k in hot:
            if cache.get(k) is None:
                cache.put(k, vec, 5)
    assert set(cache.pinned) == set(hot)
    for s in sentences[3:]:  # a scan of one-off queries
        k = cache.text_key(s, OPTS)
        if cache.get(k) is None:
            cache.put(k, vec, 5)
    assert all(cache.get(k) is not None for k in hot)


def test_tinylfu_admission_keeps_one_off_queries_out(sentences):
    vec = np.ones(384, np.float32)
    cache = ResultCache(CacheConfig(max_bytes=20_000, recent_policy="tinylfu"))
    popular = [cache.text_key(q, OPTS) for q in sentences[:8]]
    for _ in range(4):
        for k in popular:
            if cache.get(k) is None:
                cache.put(k, vec, 5)
    for s in sentences[8:]:
        k = cache.text_key(s, OPTS)
        if cache.get(k) is None:
            cache.put(k, vec, 5)
    assert cache.rejected > 0
    assert sum(cache.get(k) is not None for k in popular) >= 6


def test_new_version_never_serves_the_old_versions_results(bundled_worker, sentences, redis_server):  # noqa: F811
    texts = sentences[40:46]

    async def main():
        v1 = _service(bundled_worker, "1", redis_url=redis_server)
        v2 = _service(bundled_worker, "2", redis_url=redis_server)
        v1b = _service(bundled_worker, "1", redis_url=redis_server)  # a replica of version 1
        a = await v1.embed(texts=texts)
        await asyncio.gather(*v1._background)  # the shared-tier fill
        b = await v2.embed(texts=texts)
        c = await v1b.embed(texts=texts)
        stats = (v2.cache.stats(), v1b.cache.stats())
        for s in (v1, v2, v1b):
            await _shutdown(s)
        return a, b, c, stats

    a, b, c, (s2, s1b) = asyncio.run(main())
    assert b.cached == [False] * 6 and b.version == "2"
    assert c.cached == [True] * 6 and s1b["hits"]["shared"] == 6
    np.testing.assert_array_equal(c.vectors, a.vectors)


def test_same_version_rebuilt_with_other_settings_misses_the_shared_tier(bundled_worker, bundled_spec,
                                                                         bundled_artifact, sentences,
                                                                         redis_server):  # noqa: F811
    from surge.config import EngineConfig
    from surge.runtime.loader import build_worker

    # Version "7" reloaded with a shorter truncation: its outputs differ, so the
    # shared tier must not hand it what the first build wrote.
    short = build_worker(bundled_spec, bundled_artifact, EngineConfig(threads=1, max_seq_len=8, warmup_shapes=[(1, 8)]))
    assert short.fingerprint() != bundled_worker.fingerprint()
    assert bundled_worker.fingerprint() == bundled_worker.fingerprint()
    texts = sentences[60:64]

    async def main():
        first = _service(bundled_worker, "7", redis_url=redis_server)
        a = await first.embed(texts=texts)
        await asyncio.gather(*first._background)
        rebuilt = _service(short, "7", redis_url=redis_server)
        b = await rebuilt.embed(texts=texts)
        for svc in (first, rebuilt):
            await _shutdown(svc)
        return a, b

    a, b = asyncio.run(main())
    assert b.cached == [False] * 4
    assert not np.allclose(a.vectors, b.vectors, atol=1e-3)  # truncated to 8 tokens: really other outputs
    short.engines.close()


def test_redis_outage_is_a_miss_not_an_error(bundled_worker, sentences):
    async def main():
        svc = _service(bundled_worker, redis_url="redis://127.0.0.1:1/0")
        r = await svc.embed(texts=sentences[:2])
        await _shutdown(svc)
        return r, svc.redis.errors

    r, errors = asyncio.run(main())
    assert r.vectors.shape == (2, 384) and errors >= 1


def test_query_log_prefill_makes_first_requests_hits(bundled_worker, sentences, tmp_path):
    log = tmp_path / "log.txt"
    hot = sentences[60:64]
    log.write_text("\n".join(hot * 3 + sentences[64:70]) + "\n")

    async def main():
        svc = _service(bundled_worker, pinned_top_k=4, query_log=log)
        n = await svc.prefill_pinned()
        # A differently spaced/cased spelling of a logged query hits the pinned tier too.
        r = await svc.embed(texts=[hot[0].upper(), hot[3], sentences[65]])
        await _shutdown(svc)
        return n, r, svc.cache.stats()

    n, r, stats = asyncio.run(main())
    assert n == 4
    assert r.cached == [True, True, False]
    assert stats["pinned_entries"] == 4 and stats["hits"]["pinned"] == 2


def _fresh(worker, version):
    from prometheus_client import CollectorRegistry

    svc = ModelService(worker.spec.name, version, worker, batching=BatchingConfig(max_queue_delay_ms=2),
                       cache=CacheConfig(), metrics_registry=CollectorRegistry())
    svc.mark_ready()
    return svc


def test_concurrent_identical_misses_are_computed_once(bundled_worker, sentences, reference_embed):
    a, b = random.Random(11).sample(sentences, 2)

    async def main():
        svc = _fresh(bundled_worker, "coalesce")
        reqs = [[a]] * 16 + [[b, a]] * 4 + [[a, a, b]]  # also duplicates inside one request
        results = await asyncio.gather(*(svc.embed(texts=t) for t in reqs))
        computed = svc.metrics.batch_size._sum.get()  # inputs that reached the engine
        coalesced = svc.metrics.coalesced._value.get()
        left = len(svc._inflight)
        await _shutdown(svc)
        return results, computed, coalesced, left

    results, computed, coalesced, left = asyncio.run(main())
    assert computed == 2, f"{computed} inputs computed for 2 distinct texts"
    assert coalesced > 0 and left == 0
    ref = reference_embed([a, b])
    for res, texts in zip(results, [[a]] * 16 + [[b, a]] * 4 + [[a, a, b]]):
        want = np.stack([ref[0] if t == a else ref[1] for t in texts])
        assert np.abs(res.vectors - want).max() < 1e-4


def test_a_failed_leader_leaves_followers_to_compute(bundled_worker, sentences, reference_embed):
    import time

    from surge.errors import DeadlineExceeded

    text = random.Random(12).choice(sentences)

    async def main():
        svc = _fresh(bundled_worker, "coalesce-fail")
        # the leader's deadline passes before its batch is queued; the follower's does not
        leader = asyncio.ensure_future(svc.embed(texts=[text], deadline=time.monotonic() - 1))
        follower = asyncio.ensure_future(svc.embed(texts=[text]))
        out = await asyncio.gather(leader, follower, return_exceptions=True)
        # and a follower out of time gets its own 504 while the leader's answer stands
        other = random.Random(13).choice([s for s in sentences if s != text])
        lead2 = asyncio.ensure_future(svc.embed(texts=[other]))
        late = asyncio.ensure_future(svc.embed(texts=[other], deadline=time.monotonic() + 1e-4))
        out2 = await asyncio.gather(lead2, late, return_exceptions=True)
        left = len(svc._inflight)
        await _shutdown(svc)
        return out, out2, other, left

    (lead, follow), (lead2, late), other, left = asyncio.run(main())
    assert isinstance(lead, DeadlineExceeded)
    assert np.abs(follow.vectors[0] - reference_embed([text])[0]).max() < 1e-4
    assert isinstance(late, DeadlineExceeded)
    assert np.abs(lead2.vectors[0] - reference_embed([other])[0]).max() < 1e-4
    assert left == 0


def test_shared_tier_keys_of_token_ids_and_of_a_text_with_the_same_bytes_differ():
    """A text may hold NULs, so a client can send the very bytes that a token-id input's key is made of: the
    shared tiers (Redis, the front ends' table) hash keys, and without the input's kind in the hash that
    text's vector was stored under the token ids' key (and read back by whoever sent those ids)."""
    from surge.runtime.cache import key_hash

    opts = ("mean", True)
    ids = ResultCache.ids_key([101, 42, 102], opts)
    text = (opts, ids[1].decode("utf-8"))  # the same bytes as a str: valid UTF-8 (every byte < 0x80 here)
    assert text[1].encode() == ids[1]
    assert key_hash(ids).digest() != key_hash(text).digest()
    assert key_hash(ids).digest() == key_hash(ResultCache.ids_key([101, 42, 102], opts)).digest()
