"""The async face of one served model version: what the protocol layers call.

One entry point, `embed`, runs a Request (runtime/request.py) through explicit
stages, each a method below:

    admit (bounded, 429 past the bound) -> cache (text-keyed, before tokenizing:
    local tiers, then Redis) -> coalesce (identical inputs in flight computed
    once) -> tokenize (runtime/tokenize_stage.py: inline when short, else
    batched on a thread) -> batch (runtime/batcher.py, continuous) -> engine
    (one thread per engine instance) -> post-process (options, normalization:
    inline, microseconds) -> respond (the EmbedResult, with the stage timings)

One deadline bounds the whole request (asyncio.timeout_at: DeadlineExceeded,
504). Metrics are recorded here, once per request, whatever the protocol; the
KServe statistics are recorded from the result's timings by AppState.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from prometheus_client import CollectorRegistry

from surge.config import BatchingConfig, CacheConfig, LimitsConfig
from surge.errors import DeadlineExceeded, InvalidInput, SurgeError
from surge.runtime.admission import Admission
from surge.runtime.batcher import BatcherConfig, DynamicBatcher
from surge.runtime.cache import ResultCache, text_normalizer
from surge.runtime.coalesce import InFlight
from surge.runtime.devices import DevicePool
from surge.runtime.metrics import ServiceMetrics
from surge.runtime.outcome import admitted, answered, awaiting
from surge.runtime.request import POST, TOKENIZE, Request
from surge.runtime.tokenize_stage import TokenizeStage
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
        batcher=None,
    ):
        """`batcher`: something with DynamicBatcher's submit/close that runs the engine elsewhere
        (a front end's runtime/ipc.EngineClient under --workers); default: a local batcher over
        the worker's engines."""
        self.name = name
        self.version = version
        self.worker = worker
        self.batching = batching or BatchingConfig()
        self.cache_cfg = cache or CacheConfig()
        self.limits = limits or LimitsConfig()
        self.ready = False
        self.loaded_at = time.time()
        instances = max(1, getattr(worker.engines, "slots", 0) or len(worker.engines.engines))
        # Threads: one per engine instance, one tokenizer (long or bursty inputs only).
        self._engine_pool = (ThreadPoolExecutor(instances, thread_name_prefix=f"surge-{name}-engine")
                             if batcher is None else None)
        self._states_pool: ThreadPoolExecutor | None = None  # token_states' thread, made on first use
        # No reference back to the service (a cycle would keep a retired version's engines
        # alive until the cyclic GC runs): the stage gets the tokenizer's own function.
        self.tokenize = TokenizeStage(functools.partial(encode_inputs, worker.tokenizer), name)
        self.metrics = ServiceMetrics(name, version, metrics_registry)
        if isinstance(worker.engines, DevicePool):  # replicas over GPUs: per-device load on /metrics
            self.metrics.watch_devices(worker.engines)
        self.metrics.watch_engines(worker.engines.engines)
        b = self.batching
        self.batcher = batcher or DynamicBatcher(
            worker.compute,
            self._engine_pool,
            BatcherConfig(enabled=b.enabled, max_batch_size=min(b.max_batch_size, worker.engines.capabilities.max_batch),
                          max_batch_tokens=b.max_batch_tokens, max_queue_delay_s=b.max_queue_delay_ms / 1000.0,
                          max_queue_size=b.max_queue_size, max_padding_ratio=b.max_padding_ratio,
                          instances=instances,
                          padded=worker.layout is Layout.PADDED),
            self.metrics,
            name,
            split=_split(worker), poll_s=_poll_s(),
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
        # Under --workers: the shared-memory table every front end reads and fills (runtime/shm_cache.py).
        self.shm = None
        if self.cache is not None and c.max_bytes > 0 and worker.heads is None:
            from surge.runtime.shm_cache import ShmTier, shared_table

            table = shared_table(worker.engines.capabilities.hidden_size, c.max_bytes)
            if table is not None:
                self.shm = ShmTier(table, name, version, worker.fingerprint())
        self._background: set[asyncio.Task] = set()
        self._inflight = InFlight()  # cache keys being computed now -> their result futures
        # Tasks (issue 17): classify / rerank / token-classify entry points (runtime/tasks.py);
        # `views`: the heads of a multi-head model served under their own names (registered with it).
        from surge.runtime.tasks import TaskRunner

        self.task = worker.task
        self.kind = "hf"
        self.tasks = TaskRunner(self)
        self.views: list = []

    async def infer(self, request, head: str | None = None, **kwargs):
        """Run a task head (runtime/tasks.TaskRequest in, TaskResult out)."""
        return await self.tasks.infer(request, head, **kwargs)

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

    def on_routed(self) -> None:
        """The registry routes this build's name and version here now (ModelRegistry.add): its cache's
        state is what the cache gauges show, not a replaced build's."""
        if self.cache is not None:
            self.cache.publish()

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
        head: str | None = None,
    ) -> EmbedResult:
        """Embed texts (or token ids). `deadline` is a time.monotonic() value
        (default: now + the request timeout); higher `priority` goes first."""
        if head is None and self.task != "embed" or not self.worker.can_embed:
            from surge.runtime.tasks import require_task

            require_task(self, "embed")  # 400: model 'x' serves task 'classify', not 'embed'
        is_text = texts is not None
        options = options or EmbedOptions()
        inputs = self.prompted(texts, options.prompt_name) if is_text else (token_ids or [])
        if not is_text and options.prompt_name is not None:
            raise InvalidInput("prompt_name applies to texts, not token ids", param="prompt_name")
        start = time.monotonic()
        with admitted(self, len(inputs), check=lambda: self.check_options(options)):  # stage: admit
            if deadline is None:
                deadline = start + self.limits.request_timeout_s
            req = Request(inputs, is_text, options, deadline, priority, start)
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
                    await self._run(req)
            except TimeoutError:
                raise DeadlineExceeded(f"request did not finish within "
                                       f"{deadline - start:.3g} s") from None
            result = req.result(self.name, self.version, self.dimensions)  # stage: respond
            answered(self.metrics, time.monotonic() - start)
            return result

    async def _run(self, req: Request) -> None:
        """cache -> coalesce -> tokenize -> batch/engine -> post-process, filling req's slots. The warm-up
        (metrics quiet) skips the cache: its text is no client's, neither looked up nor kept."""
        cached = self.cache is not None and not self.metrics.is_quiet
        miss = await self._from_cache(req) if cached else list(range(req.n))
        if not miss:
            return
        if req.keys is None:
            await self._compute(req, miss)
            return
        # stage: coalesce (inputs another request computes right now are awaited, not redone)
        claim = self._inflight.claim(req.keys, miss)
        ok = False
        try:
            if claim.lead:
                await self._compute(req, claim.lead)
            ok = True
        finally:
            self._inflight.settle(claim, req.vectors, req.tokens, ok)
        if claim.follow:
            retry, filled = await self._inflight.wait(claim, req.vectors, req.tokens, req.deadline)
            self.metrics.coalesced.inc(filled)
            if retry:  # the leader failed: compute them here
                await self._compute(req, retry)

    async def prefill_pinned(self, batch: int = 64) -> int:
        """Compute the query log's pinned queries ahead of their first request.

        Runs at low priority (user requests go first) once the service is
        ready; returns how many queries were computed.
        """
        cache = self.cache
        if cache is None or not cache.static_hot:
            return 0
        # its own task (runtime/repository._prefill), maybe started inside a load request's: its computations
        # count when done, not by that request's answer's delivery (runtime/outcome.awaiting)
        awaiting(None)
        okey = EmbedOptions().key()
        todo = sorted(k[1] for k in cache.static_hot if k[0] == okey and not cache.contains(k))
        for i in range(0, len(todo), batch):
            # Normalized texts tokenize like the originals, so their keys match.
            await self.embed(texts=todo[i:i + batch], priority=-1)
        return len(todo)

    def prompted(self, texts: list[str], prompt_name: str | None = None) -> list[str]:
        """The texts with the model's sentence-transformers prompt `prompt_name` before each (None: its
        default_prompt_name's, if it names one), as sentence-transformers' encode(prompt_name=...) puts it."""
        spec = self.worker.spec
        name = spec.default_prompt_name if prompt_name is None else prompt_name
        if name is None:
            return texts
        if name not in spec.prompts:
            have = ", ".join(spec.prompts) or "none"
            raise InvalidInput(f"prompt_name {name!r} is not one of model {self.name}'s prompts ({have})",
                               param="prompt_name")
        prompt = spec.prompts[name]
        if not prompt:
            return texts
        if not spec.pool_prompt and spec.pooling != "last":
            raise InvalidInput(f"model {self.name} pools without its prompt's tokens (include_prompt: false), which "
                               "surge does not implement: send the text without prompt_name", param="prompt_name")
        return [prompt + t for t in texts]

    def cached_result(self, texts: list[str], options: EmbedOptions | None = None,
                      accept=None) -> EmbedResult | None:
        """The answer when every input is in the local cache tiers, else None.

        Synchronous and cheap: the HTTP hot path (server/http/hotpath.py) calls
        it before any framework work. A None counts nothing; the request then
        takes the full path, which does the counting. `accept(result)`: whether
        the caller answers with it; a refusal is such a None, so that a request
        handed on to the full path is not counted twice.
        """
        cache = self.cache
        if cache is None or not self.ready or not texts:
            return None
        options = options or EmbedOptions()
        okey = options.key()
        try:
            texts = self.prompted(texts, options.prompt_name)
        except InvalidInput:
            return None  # the full path reports it
        keys = [cache.text_key(t, okey) for t in texts]
        start = time.monotonic()
        entries = [cache.peek(k) for k in keys]
        if any(e is None for e in entries):
            return None
        result = EmbedResult(np.stack([e.vector for e in entries]), sum(e.tokens for e in entries), self.name,
                             self.version, [True] * len(keys), [e.tokens for e in entries])
        if accept is not None and not accept(result):
            return None
        m = self.metrics
        m.requests.inc()
        m.inputs.inc(len(keys))
        for k in keys:
            cache.get(k)  # counts the hit, refreshes recency and popularity
        answered(m, time.monotonic() - start)  # once delivered, where the caller awaits that (runtime/outcome.py)
        return result

    async def _from_cache(self, req: Request) -> list[int]:
        """Stage cache: fill hits from the local tiers, then Redis; the positions still missing."""
        cache = self.cache
        okey = req.options.key()
        req.keys = keys = ([cache.text_key(t, okey) for t in req.inputs] if req.is_text
                           else [cache.ids_key(ids, okey) for ids in req.inputs])
        miss = []
        count_miss = self.redis is None and self.shm is None
        for i, k in enumerate(keys):
            e = cache.get(k, count_miss)
            if e is None:
                miss.append(i)
            else:
                req.fill(i, e.vector, e.tokens, cached=True)
        if miss and self.shm is not None:  # the table every front end shares (--workers)
            miss = cache.fill_from("shm", keys, miss, [self.shm.get(keys[i]) for i in miss],
                                   lambda i, vector, tokens: req.fill(i, vector, tokens, cached=True),
                                   count_miss=self.redis is None)
        if miss and self.redis is not None:
            from surge.runtime.cache_redis import shared_lookup

            miss = await shared_lookup(cache, self.redis, keys, miss,
                                       lambda i, vector, tokens: req.fill(i, vector, tokens, cached=True),
                                       width=req.options.dimensions or self.dimensions)
        return miss

    async def _compute(self, req: Request, miss: list[int]) -> None:
        """Stages tokenize -> batch -> engine -> post-process for the inputs at `miss`."""
        m = self.metrics
        sub = [req.inputs[i] for i in miss]
        t = time.monotonic()
        encs: list[Encoded] = await self.tokenize.encode(sub if req.is_text else None,
                                                         None if req.is_text else sub, req.options.truncate,
                                                         req.options.left)
        took = time.monotonic() - t
        m.tokenize.observe(took)
        req.add_time(TOKENIZE, took)
        pooled = await self.batcher.submit(encs, req.deadline, req.priority, req.timings)
        t = time.monotonic()
        out = self.worker.finish(pooled, req.options)  # row-wise options and normalization: microseconds
        took = time.monotonic() - t
        m.post.observe(took)
        req.add_time(POST, took)
        if out.shape[0] != len(miss):  # finish is row-wise; this guards the contract
            raise SurgeError(f"post-processing returned {out.shape[0]} rows for {len(miss)} inputs")
        fills = []
        for j, i in enumerate(miss):
            req.fill(i, out[j], len(encs[j]))
            if req.keys is not None:
                self.cache.put(req.keys[i], out[j], len(encs[j]))
                if self.shm is not None:
                    self.shm.put(req.keys[i], out[j], len(encs[j]))
                fills.append((req.keys[i], out[j], len(encs[j])))
        if fills and self.redis is not None:
            # Filling the shared tier is not on the response's path.
            task = asyncio.get_running_loop().create_task(self.redis.put_many(fills))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @property
    def can_return_tokens(self) -> bool:
        """Whether token_states has a hidden state to return: this process's engines (ModelWorker's), or the
        engine process's (its HELLO / CATALOG says, under --workers)."""
        remote = getattr(self.batcher, "can_return_tokens", None)
        return self.worker.can_return_tokens if remote is None else bool(remote)

    async def token_states(self, texts: list[str], truncate: bool, left: bool = False,
                           prompt_name: str | None = None) -> list[np.ndarray]:
        """TEI's /embed_all: each text's last hidden state [n_tokens, hidden] float32 (runtime/token_states.py:
        admitted as embed is, 413 past --max-token-states-bytes)."""
        from surge.runtime import token_states

        return await token_states.token_states(self, texts, truncate, left, prompt_name)

    def held_token_states(self, texts: list[str], truncate: bool, left: bool = False,
                          prompt_name: str | None = None, deadline: float | None = None):
        """token_states as an async context manager: its TokenStates, with the admission slot held until the
        block ends (the HTTP route sends the answer inside: runtime/token_states.held)."""
        from surge.runtime import token_states

        return token_states.held(self, texts, truncate, left, prompt_name, deadline)

    def on_states_thread(self, fn, *args) -> asyncio.Future:
        """`fn(*args)` (ModelWorker.token_states) on this service's one thread for per-token runs, beside the
        batcher's engine threads: a long /embed_all never holds the thread a batch's compute (or, on CUDA, its
        wait) needs, and such runs go one at a time; admission bounds what queues for it. Cancelled, before
        it starts, with the returned future."""
        if self._engine_pool is None:
            raise SurgeError(f"model {self.name}'s engines run in another process")
        if self._states_pool is None:
            self._states_pool = ThreadPoolExecutor(1, thread_name_prefix=f"surge-{self.name}-states")
        return asyncio.get_running_loop().run_in_executor(self._states_pool, fn, *args)

    def encode(self, texts: list[str] | None, token_ids: list[list[int]] | None, truncate: bool,
               left: bool = False) -> list[Encoded]:
        return encode_inputs(self.worker.tokenizer, texts, token_ids, truncate, left)

    async def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's token count before truncation, the model's default prompt included (on the tokenizer's
        thread, off the event loop)."""
        return await self.tokenize.off_loop(self.worker.tokenizer.count_untruncated, self.prompted(texts))

    async def close(self) -> None:
        """Stop taking requests, drain in-flight work, then free the engines."""
        self.ready = False
        await self.admission.drain()
        await self.batcher.close()
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        self.tokenize.close()
        if self._engine_pool is not None:
            self._engine_pool.shutdown(wait=True, cancel_futures=False)
        if self._states_pool is not None:
            self._states_pool.shutdown(wait=True, cancel_futures=False)
        self.worker.engines.close()
        if self.redis is not None:
            await self.redis.close()
        self.metrics.close()
        # A multi-head model's views hold this service (they forward to it): out of routing by now, they
        # are let go, so that no reference cycle keeps this retired build (runtime/gc_settle.py).
        self.views = []


def _split(worker: ModelWorker):
    """The worker's launch / wait / collect halves where its engines have them (CUDA torch engines
    pooling in their graphs); SURGE_SPLIT_LAUNCH=0 runs whole batches on the engine thread instead."""
    import os

    if not getattr(worker, "can_launch", False) or os.environ.get("SURGE_SPLIT_LAUNCH", "1") == "0":
        return None
    return worker.compute_launch, worker.compute_wait, worker.compute_collect, worker.compute_ready


def _poll_s() -> float:
    """How long the batcher checks a launched batch on its loop before waiting on a thread
    (SURGE_WAIT_POLL_US, microseconds; 0: always the thread)."""
    import os

    return max(0.0, float(os.environ.get("SURGE_WAIT_POLL_US", "2000"))) / 1e6


def encode_inputs(tokenizer, texts: list[str] | None, token_ids: list[list[int]] | None,
                  truncate: bool, left: bool = False) -> list[Encoded]:
    """`left`: a too-long input keeps its last tokens (TEI's truncation_direction "left")."""
    if texts is not None:
        return tokenizer.encode(texts, truncate=truncate, left=left)
    return tokenizer.from_ids(token_ids or [], truncate=truncate, left=left)
