"""The async face of one served model version: what the protocol layers call.

Compute never runs on the event loop: it goes to a thread pool sized to the
engine instances. The batcher and cache (runtime/batcher.py, runtime/cache.py)
plug in here.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from surge.config import BatchingConfig, CacheConfig, LimitsConfig
from surge.errors import InvalidInput, NotReady
from surge.runtime.worker import ModelWorker
from surge.types import EmbedOptions, EmbedResult, Encoded


class ModelService:
    def __init__(
        self,
        name: str,
        version: str,
        worker: ModelWorker,
        batching: BatchingConfig | None = None,
        cache: CacheConfig | None = None,
        limits: LimitsConfig | None = None,
    ):
        self.name = name
        self.version = version
        self.worker = worker
        self.batching = batching or BatchingConfig()
        self.cache_cfg = cache or CacheConfig()
        self.limits = limits or LimitsConfig()
        self.ready = False
        self.loaded_at = time.time()
        self._pool = ThreadPoolExecutor(
            max_workers=len(worker.engines.engines) + 1, thread_name_prefix=f"surge-{name}"
        )

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
    ) -> EmbedResult:
        if not self.ready:
            raise NotReady(f"model {self.name} version {self.version} is not ready")
        options = options or EmbedOptions()
        self.check_options(options)
        loop = asyncio.get_running_loop()
        vectors, n_tokens = await loop.run_in_executor(self._pool, self._embed_sync, texts, token_ids, options)
        return EmbedResult(vectors, n_tokens, self.name, self.version, [False] * len(vectors))

    def encode(self, texts: list[str] | None, token_ids: list[list[int]] | None, truncate: bool) -> list[Encoded]:
        if texts is not None:
            return self.worker.tokenizer.encode(texts, truncate=truncate)
        return self.worker.tokenizer.from_ids(token_ids or [], truncate=truncate)

    def _embed_sync(self, texts, token_ids, options: EmbedOptions):
        items = self.encode(texts, token_ids, options.truncate)
        vectors = self.worker.compute(items)
        return self.worker.finish(vectors, options), sum(len(i) for i in items)

    async def close(self) -> None:
        self.ready = False
        self._pool.shutdown(wait=True, cancel_futures=False)
        self.worker.engines.close()
