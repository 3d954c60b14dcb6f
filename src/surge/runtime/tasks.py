"""The task entry point of a served encoder: classify, rerank, token-classify (and embed heads).

A `ModelService` whose worker carries heads (engines/heads.py) answers
`infer(TaskRequest)` here. The path is the embedding path's: admission ->
cache (keyed by the inputs, the truncation options and the model's head set)
-> the shared Redis tier when configured (keys carry the model's build fingerprint, which names
its task and heads) -> tokenize on an executor thread (runtime/tokenize.py's tokenizer is safe to
share between threads) -> the same dynamic batcher (one
backbone pass computes every head of the model for an input; pairs are items
like any other, so one query with 100 documents is packed into batches by the
token budget and comes back in order) -> this head's slice of each row.

Post-processing that depends on request options (softmax / sigmoid, label
names, top-k, entity aggregation) is the protocol layer's: results here are
raw logits, so one cache entry serves every option.

`HeadView` is one head of a multi-head model, served under its own name.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from surge.engines.heads import Head
from surge.errors import EmptyInput, InvalidInput, PayloadTooLarge, SurgeError, WrongTask
from surge.runtime.outcome import admitted, answered


@dataclass
class TaskRequest:
    """Inputs of one task call: texts, or (text, text_pair) pairs (a reranker's (query, document))."""

    texts: list[str] | None = None
    pairs: list[tuple[str, str]] | None = None
    truncate: bool = True
    param: str = "inputs"  # the request field the inputs came from (error messages name it)
    truncation_direction: str = "right"  # "left": a too-long input keeps its last tokens (TEI's)

    @property
    def left(self) -> bool:
        return self.truncate and self.truncation_direction == "left"

    @property
    def items(self) -> list:
        return list(self.pairs) if self.pairs is not None else list(self.texts or [])


@dataclass
class TaskResult:
    head: Head
    outputs: list[np.ndarray]  # per input: [labels] logits, [hidden] pooled, or [n_tokens, labels] logits
    prompt_tokens: int
    model: str
    version: str
    cached: list[bool] = field(default_factory=list)
    encodings: list | None = None  # tokenizers Encodings (token-classify: offsets, special tokens)
    timings: dict = field(default_factory=dict)  # stage -> ns (runtime/request.py's keys), as EmbedResult's

    @property
    def vectors(self) -> list[np.ndarray]:  # what the statistics count (one per input), as EmbedResult's
        return self.outputs


def require_task(served, *tasks: str) -> None:
    """400 naming the model's task when it serves none of `tasks`."""
    task = getattr(served, "task", "embed")
    if task not in tasks:
        raise WrongTask(f"model '{served.name}' serves task '{task}', not '{' or '.join(tasks)}'", param="model")


class TaskRunner:
    """The service's task entry points. It holds its service weakly: the service holds it (`tasks`), and
    a strong reference back would make a cycle that keeps a retired build alive until a full collection
    (runtime/gc_settle.py: retired builds are freed by reference counting)."""

    def __init__(self, service):
        self._service = weakref.ref(service)

    @property
    def service(self):
        return self._service()

    @property
    def heads(self):
        return self.service.worker.heads

    def head(self, name: str | None) -> Head:
        heads = self.heads
        if heads is None:
            raise WrongTask(f"model '{self.service.name}' serves task 'embed' only", param="model")
        if name is None:
            return heads.first
        try:
            return heads[name]
        except KeyError:
            raise InvalidInput(f"model '{self.service.name}' has no head '{name}'", param="model") from None

    async def infer(self, req: TaskRequest, head: str | None = None, *, priority: int = 0,
                    deadline: float | None = None) -> TaskResult:
        s = self.service
        h = self.head(head)
        items = req.items
        n = len(items)
        if n == 0:
            raise EmptyInput(f"'{req.param}' must not be empty", param=req.param)
        if n > s.limits.max_inputs_per_request:
            raise PayloadTooLarge(f"'{req.param}' has {n} entries, more than the limit of "
                                  f"{s.limits.max_inputs_per_request}", param=req.param)
        start = time.monotonic()
        with admitted(s, n):
            deadline = deadline if deadline is not None else start + s.limits.request_timeout_s
            result = await self._infer(req, items, h, priority, deadline)
            answered(s.metrics, time.monotonic() - start)
            return result

    def _key(self, item, okey):
        cache = self.service.cache
        if isinstance(item, tuple):  # pairs under their own options key; JSON keeps the two sides apart
            return ((*okey, "pair"), json.dumps([cache.normalize(item[0]), cache.normalize(item[1])]))
        return cache.text_key(item, okey)

    async def _infer(self, req: TaskRequest, items: list, h: Head, priority: int, deadline: float) -> TaskResult:
        s = self.service
        loop = asyncio.get_running_loop()
        n = len(items)
        rows: list[np.ndarray | None] = [None] * n
        tokens = [0] * n
        cached = [False] * n
        # the warm-up (metrics quiet) leaves the cache alone, as embeddings' does
        cache = None if getattr(s.metrics, "is_quiet", False) else s.cache
        # every head's raw output, per truncation; never an embedding key (those start with `normalize`)
        okey = ("heads", req.truncate, "left" if req.left else "right")
        keys = [self._key(it, okey) for it in items] if cache is not None else None
        miss = list(range(n))
        redis = getattr(s, "redis", None)  # the shared tier (runtime/cache_redis.py), as embeddings use it
        if keys is not None:
            miss = []
            for i, k in enumerate(keys):
                e = cache.get(k, redis is None)
                if e is None:
                    miss.append(i)
                else:
                    rows[i], tokens[i], cached[i] = e.vector, e.tokens, True
            if miss and redis is not None:  # fills the local tiers and counts shared hits and misses
                from surge.runtime.cache_redis import shared_lookup

                def fill(i, vector, n_tokens):
                    rows[i], tokens[i], cached[i] = vector, n_tokens, True

                miss = await shared_lookup(cache, redis, keys, miss, fill)
        need_encodings = h.task == "token-classify"
        encodings = None
        timings: dict = {}  # the KServe statistics' stages: tokenize, queue, engine (the batcher's), heads
        tok = s.worker.tokenizer
        if miss or need_encodings:
            todo = items if need_encodings else [items[i] for i in miss]
            t = time.monotonic()
            encs = await loop.run_in_executor(None, tok.encodings, todo, req.truncate, req.param, req.left)
            s.metrics.tokenize.observe(time.monotonic() - t)
            timings["compute_input_ns"] = int((time.monotonic() - t) * 1e9)
            if need_encodings:
                encodings = encs
                encs = [encs[i] for i in miss]
            if miss:
                out = await s.batcher.submit(tok.to_encoded(encs), deadline, priority, timings)
                if len(out) != len(miss):
                    raise SurgeError(f"the engine returned {len(out)} rows for {len(miss)} inputs")
                fills = []
                for j, i in enumerate(miss):
                    rows[i], tokens[i] = np.asarray(out[j], dtype=np.float32), len(encs[j].ids)
                    if keys is not None:
                        cache.put(keys[i], rows[i], tokens[i])
                        fills.append((keys[i], rows[i], tokens[i]))
                if fills and redis is not None:  # off the response's path, as the embedding path fills it
                    task = loop.create_task(redis.put_many(fills))
                    s._background.add(task)
                    task.add_done_callback(s._background.discard)
        heads = s.worker.heads
        t = time.monotonic()
        outputs = [heads.split(rows[i], h.name, tokens[i]) for i in range(n)]
        if miss:
            timings["compute_output_ns"] = int((time.monotonic() - t) * 1e9)
        return TaskResult(h, outputs, sum(tokens), s.name, s.version, cached, encodings, timings)


class HeadView:
    """One head of a multi-head model under its own name: a served model like any other
    (name, version, ready, task, kind), backed by the shared service (one backbone pass)."""

    kind = "hf"

    def __init__(self, service, head: Head, name: str):
        self.service = service
        self.head = head
        self.name = name
        self.task = head.task

    def __getattr__(self, item):
        return getattr(self.service, item)

    def __repr__(self) -> str:
        return f"HeadView({self.name!r} -> {self.service.name!r}:{self.head.name})"

    @property
    def version(self) -> str:
        return self.service.version

    @property
    def ready(self) -> bool:
        return self.service.ready

    def mark_ready(self) -> None:
        pass  # readiness is the backbone service's

    async def infer(self, req: TaskRequest, head: str | None = None, **kw) -> TaskResult:
        result = await self.service.tasks.infer(req, head or self.head.name, **kw)
        result.model = self.name  # answers (and pipeline provenance) name the head's model
        return result

    async def embed(self, *args, **kwargs):
        if self.task != "embed":
            require_task(self, "embed")
        result = await self.service.embed(*args, head=self.head.name, **kwargs)
        result.model = self.name
        return result

    def cached_result(self, *args, **kwargs):
        return None  # the hot path's cache keys are the backbone's; views take the full path

    async def close(self) -> None:
        pass  # the backbone service is closed once, as itself
