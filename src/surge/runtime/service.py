"""The async face of one served model version: what the protocol layers call.

A request goes: admission (bounded, 429 past the bound) -> cache lookup
(text-keyed, before tokenizing; local tiers, then Redis) -> tokenize (a thread)
-> dynamic batcher -> engine run (one thread per engine instance) -> post-process
(pool already done in the engine stage; options, normalization in a thread) ->
cache fill. The three compute stages run in separate threads, so tokenizing
the next request and finishing the previous one overlap with the engine, and
the event loop never runs compute.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from prometheus_client import CollectorRegistry

from surge.config import BatchingConfig, CacheConfig, LimitsConfig
from surge.errors import InvalidInput, NotReady, SurgeError
from surge.runtime.admission import Admission
from surge.runtime.batcher import BatcherConfig, DynamicBatcher
from surge.runtime.cache import ResultCache, text_normalizer
from surge.runtime.coalesce import InFlight
from surge.runtime.devices import DevicePool
from surge.runtime.metrics import ServiceMetrics
from surge.runtime.worker import ModelWorker
from surge.types import EmbedOptions, EmbedResult, Encoded, Layout


class ModelService:
    def __init__(
        self,
        name: str,
        version: str,
        worker: ModelWorker,
        batching: BatchingConfig | None = None,
        cache: CacheConfig | None = None,
        limits: LimitsConfig | None = None,
        metrics_registry: CollectorRegistry | None = None,
    ):
        self.name = name
        self.version = version
        self.worker = worker
        self.batching = batching or BatchingConfig()
        self.cache_cfg = cache or CacheConfig()
        self.limits = limits or LimitsConfig()
        self.ready = False
        self.loaded_at = time.time()
        instances = len(worker.engines.engines)
        # One thread per stage (per engine instance for the engine stage).
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix=f"surge-{name}-tok")
        self._engine_pool = ThreadPoolExecutor(instances, thread_name_prefix=f"surge-{name}-engine")
        self._post_pool = ThreadPoolExecutor(1, thread_name_prefix=f"surge-{name}-post")
        self.metrics = ServiceMetrics(name, version, metrics_registry)
        if isinstance(worker.engines, DevicePool):  # replicas over GPUs: per-device load on /metrics
            self.metrics.watch_devices(worker.engines)
        self.metrics.watch_engines(worker.engines.engines)
        b = self.batching
        self.batcher = DynamicBatcher(
            worker.compute,
            self._engine_pool,
            BatcherConfig(enabled=b.enabled, max_batch_size=min(b.max_batch_size, worker.engines.capabilities.max_batch),
                          max_batch_tokens=b.max_batch_tokens, max_queue_delay_s=b.max_queue_delay_ms / 1000.0,
                          max_queue_size=b.max_queue_size, max_padding_ratio=b.max_padding_ratio,
                          instances=instances,
                          padded=worker.layout is Layout.PADDED),
            self.metrics,
            name,
        )
        inflight = b.max_inflight or b.max_queue_size + instances * b.max_batch_size
        self.admission = Admission(inflight, name)
        c = self.cache_cfg
        self.cache: ResultCache | None = None
        self.redis = None
        if c.enabled and (c.max_bytes > 0 or c.pinned_top_k > 0):
            self.cache = ResultCache(c, name, version, self.metrics, text_normalizer(worker.tokenizer.backend),
                                     default_options=EmbedOptions().key())
            if c.redis_url:
                from surge.runtime.cache_redis import RedisTier

                self.redis = RedisTier(c.redis_url, name, version, c.redis_ttl_s, build=worker.fingerprint())
        self._background: set[asyncio.Task] = set()
        self._inflight = InFlight()  # cache keys being computed now -> their result futures

    @property
    def spec(self):
        return self.worker.spec

    @property
    def dimensions(self) -> int:
        return self.worker.spec.hidden_size

    @property
    def max_length(self) -> int:
        return self.worker.tokenizer.max_length

    def mark_ready(self) -> None:
        self.ready = True

    def check_options(self, options: EmbedOptions) -> None:
        if options.dimensions is not None and not (1 <= options.dimensions <= self.dimensions):
            raise InvalidInput(
                f"dimensions must be between 1 and {self.dimensions} for model {self.name}", param="dimensions"
            )

    async def embed(
        self,
        texts: list[str] | None = None,
        token_ids: list[list[int]] | None = None,
        options: EmbedOptions | None = None,
        *,
        priority: int = 0,
        deadline: float | None = None,
    ) -> EmbedResult:
        """Embed texts (or token ids). `deadline` is a time.monotonic() value
        (default: now + the request timeout); higher `priority` goes first."""
        m = self.metrics
        n = len(texts if texts is not None else token_ids or [])
        m.requests.inc()
        m.inputs.inc(n)
        start = time.monotonic()
        admitted = False
        try:
            if not self.ready:
                raise NotReady(f"model {self.name} version {self.version} is not ready")
            options = options or EmbedOptions()
            self.check_options(options)
            self.admission.admit(n)
            admitted = True
            m.inflight.inc(n)
            if deadline is None:
                deadline = start + self.limits.request_timeout_s
            result = await self._embed(texts, token_ids, options, priority, deadline)
            m.latency.observe(time.monotonic() - start)
            return result
        except SurgeError as exc:
            m.failure(exc.code)
            raise
        except asyncio.CancelledError:
            m.failure("cancelled")
            raise
        except Exception:
            m.failure("internal_error")
            raise
        finally:
            if admitted:
                m.inflight.dec(n)
                self.admission.release(n)

    async def prefill_pinned(self, batch: int = 64) -> int:
        """Compute the query log's pinned queries ahead of their first request.

        Runs at low priority (user requests go first) once the service is
        ready; returns how many queries were computed.
        """
        cache = self.cache
        if cache is None or not cache.static_hot:
            return 0
        okey = EmbedOptions().key()
        todo = sorted(k[1] for k in cache.static_hot if k[0] == okey and not cache.contains(k))
        for i in range(0, len(todo), batch):
            # Normalized texts tokenize like the originals, so their keys match.
            await self.embed(texts=todo[i:i + batch], priority=-1)
        return len(todo)

    def cached_result(self, texts: list[str], options: EmbedOptions | None = None) -> EmbedResult | None:
        """The answer when every input is in the local cache tiers, else None.

        Synchronous and cheap: the HTTP hot path (server/http/hotpath.py) calls
        it before any framework work. A None counts nothing; the request then
        takes the full path, which does the counting.
        """
        cache = self.cache
        if cache is None or not self.ready or not texts:
            return None
        options = options or EmbedOptions()
        okey = options.key()
        keys = [cache.text_key(t, okey) for t in texts]
        if not all(cache.contains(k) for k in keys):
            return None
        start = time.monotonic()
        m = self.metrics
        m.requests.inc()
        m.inputs.inc(len(keys))
        entries = [cache.get(k) for k in keys]
        out = np.stack([e.vector for e in entries])
        m.latency.observe(time.monotonic() - start)
        return EmbedResult(out, sum(e.tokens for e in entries), self.name, self.version, [True] * len(keys))

    async def _embed(self, texts, token_ids, options: EmbedOptions, priority: int, deadline: float) -> EmbedResult:
        inputs = texts if texts is not None else token_ids
        n = len(inputs)
        vectors: list[np.ndarray | None] = [None] * n
        tokens = [0] * n
        cached = [False] * n
        miss = list(range(n))
        keys = None
        cache = self.cache
        if cache is not None:
            okey = options.key()
            keys = ([cache.text_key(t, okey) for t in texts] if texts is not None
                    else [cache.ids_key(ids, okey) for ids in token_ids])
            miss = []
            count_miss = self.redis is None
            for i, k in enumerate(keys):
                e = cache.get(k, count_miss)
                if e is None:
                    miss.append(i)
                else:
                    vectors[i], tokens[i], cached[i] = e.vector, e.tokens, True
            if miss and self.redis is not None:
                miss = await self._shared_lookup(keys, miss, vectors, tokens, cached)
        if miss and keys is not None:
            await self._compute_once(inputs, texts is not None, miss, options, priority, deadline, vectors, tokens, keys)
        elif miss:
            await self._compute(inputs, texts is not None, miss, options, priority, deadline, vectors, tokens, keys)
        out = np.stack(vectors) if n else np.zeros((0, self.dimensions), np.float32)
        return EmbedResult(out, sum(tokens), self.name, self.version, cached)

    async def _shared_lookup(self, keys, miss, vectors, tokens, cached) -> list[int]:
        found = await self.redis.get_many([keys[i] for i in miss])
        still = []
        for i, f in zip(miss, found):
            if f is None:
                still.append(i)
                continue
            entry = self.cache.put(keys[i], f[0], f[1])
            self.cache.count_shared_hit()
            vectors[i], tokens[i], cached[i] = entry.vector, entry.tokens, True
        self.cache.count_miss(len(still))
        return still

    async def _compute_once(self, inputs, is_text, miss, options, priority, deadline, vectors, tokens, keys) -> None:
        """_compute, except that inputs another request is computing right now are awaited, not redone."""
        claim = self._inflight.claim(keys, miss)
        ok = False
        try:
            if claim.lead:
                await self._compute(inputs, is_text, claim.lead, options, priority, deadline, vectors, tokens, keys)
            ok = True
        finally:
            self._inflight.settle(claim, vectors, tokens, ok)
        if claim.follow:
            retry, filled = await self._inflight.wait(claim, vectors, tokens, deadline)
            self.metrics.coalesced.inc(filled)
            if retry:  # the leader failed: compute them here
                await self._compute(inputs, is_text, retry, options, priority, deadline, vectors, tokens, keys)

    async def _compute(self, inputs, is_text, miss, options, priority, deadline, vectors, tokens, keys) -> None:
        loop = asyncio.get_running_loop()
        m = self.metrics
        sub = [inputs[i] for i in miss]
        t = time.monotonic()
        encs: list[Encoded] = await loop.run_in_executor(
            self._tok_pool, self.encode, sub if is_text else None, None if is_text else sub, options.truncate)
        m.tokenize.observe(time.monotonic() - t)
        pooled = await self.batcher.submit(encs, deadline, priority)
        t = time.monotonic()
        out = await loop.run_in_executor(self._post_pool, self.worker.finish, pooled, options)
        m.post.observe(time.monotonic() - t)
        if out.shape[0] != len(miss):  # finish is row-wise; this guards the contract
            raise SurgeError(f"post-processing returned {out.shape[0]} rows for {len(miss)} inputs")
        fills = []
        for j, i in enumerate(miss):
            vectors[i], tokens[i] = out[j], len(encs[j])
            if keys is not None:
                self.cache.put(keys[i], out[j], len(encs[j]))
                fills.append((keys[i], out[j], len(encs[j])))
        if fills and self.redis is not None:
            # Filling the shared tier is not on the response's path.
            task = loop.create_task(self.redis.put_many(fills))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def encode(self, texts: list[str] | None, token_ids: list[list[int]] | None, truncate: bool) -> list[Encoded]:
        if texts is not None:
            return self.worker.tokenizer.encode(texts, truncate=truncate)
        return self.worker.tokenizer.from_ids(token_ids or [], truncate=truncate)

    async def close(self) -> None:
        """Stop taking requests, drain in-flight work, then free the engines."""
        self.ready = False
        await self.admission.drain()
        await self.batcher.close()
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        for pool in (self._tok_pool, self._engine_pool, self._post_pool):
            pool.shutdown(wait=True, cancel_futures=False)
        self.worker.engines.close()
        if self.redis is not None:
            await self.redis.close()
        self.metrics.close()
