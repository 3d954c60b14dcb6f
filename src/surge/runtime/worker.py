"""One model's compute path: tokenize -> engine.run -> pool -> normalize.

`ModelWorker` is synchronous and owns the engine instances; the async
`ModelService` (runtime/service.py) decides when and with what it runs.
"""

from __future__ import annotations

import itertools
import queue
from dataclasses import dataclass

import numpy as np

from surge.engines.base import Engine
from surge.engines.pooling import l2_normalize, pool
from surge.errors import EngineError
from surge.models.hf import ModelSpec
from surge.runtime.file_sample import update_sampled
from surge.runtime.tokenize import Tokenizer
from surge.types import EmbedOptions, Encoded, Layout, TokenBatch


@dataclass(frozen=True)
class PostSpec:
    pooling: str
    normalize: bool


class EnginePool:
    """Engine instances handed out one caller at a time (a blocking checkout)."""

    def __init__(self, engines: list[Engine]):
        if not engines:
            raise ValueError("at least one engine instance is needed")
        self.engines = engines
        self._free: queue.SimpleQueue[Engine] = queue.SimpleQueue()
        # An engine that keeps several batches in flight (TorchEngine on CUDA: double-buffered
        # staging) is handed out that many times; `slots` is how many batches run at once.
        self.slots = 0
        for e in engines:
            for _ in range(max(1, int(getattr(e, "pipeline_depth", 1) or 1))):
                self._free.put(e)
                self.slots += 1

    @property
    def capabilities(self):
        return self.engines[0].capabilities

    def run(self, batch: TokenBatch) -> np.ndarray:
        engine = self._free.get()
        try:
            return engine.run(batch)
        finally:
            self._free.put(engine)

    def launch(self, batch: TokenBatch):
        """An instance's launch (TorchEngine.launch); the batcher holds a slot, so one is free."""
        engine = self._free.get()
        try:
            return engine, engine.launch(batch)
        except BaseException:
            self._free.put(engine)
            raise

    def collect(self, token) -> np.ndarray:
        engine, job = token
        try:
            return engine.collect(job)
        finally:
            self._free.put(engine)

    def run_heads(self, batch: TokenBatch) -> np.ndarray:
        """Head rows computed by the engine itself (TorchEngine.attach_heads: inside its CUDA graph)."""
        engine = self._free.get()
        try:
            return engine.run_heads(batch)
        finally:
            self._free.put(engine)

    def close(self) -> None:
        for e in self.engines:
            e.close()


class ModelWorker:
    def __init__(self, spec: ModelSpec, tokenizer: Tokenizer, engines: EnginePool, post: PostSpec, heads=None):
        self.spec = spec
        self.tokenizer = tokenizer
        self.engines = engines
        self.post = post
        # engines/heads.HeadSet for task models (classify, rerank, token-classify, several heads on one
        # backbone); None: a plain embedding model, whose rows are pooled vectors.
        self.heads = heads
        # Every engine computes the heads itself (GPU: inside the captured graph): rows come straight back.
        self.engine_heads = heads is not None and isinstance(engines, EnginePool) and all(
            getattr(e, "head_set", None) is heads for e in engines.engines)
        # Every engine pools inside its graph (TorchEngine.attach_pooling): its rows are the pooled vectors.
        self.engine_pools = heads is None and bool(engines.engines) and all(
            getattr(e, "pool_mode", None) == post.pooling for e in engines.engines)
        # ... and can split a batch into launch (host work, on the batcher's event loop) and collect.
        self.can_launch = self.engine_pools and isinstance(engines, EnginePool) and all(
            hasattr(e, "launch") for e in engines.engines)
        self._hidden_turn = itertools.count()  # token_states' engine, in turn, where the graphs pool

    @property
    def task(self) -> str:
        return self.heads.first.task if self.heads is not None else "embed"

    @property
    def can_embed(self) -> bool:
        return self.heads is None or any(h.task == "embed" for h in self.heads.heads)

    @property
    def layout(self) -> Layout:
        return self.engines.capabilities.layout

    def fingerprint(self) -> str:
        """What makes this build's outputs what they are, the same in every process.

        Keys the shared (Redis) cache tier next to (model, version), so that a
        version reloaded with other settings or weights never reads results an
        earlier build wrote. Cheap: weights are sampled (size, head, tail), not hashed.
        """
        import hashlib
        import json

        caps = self.engines.capabilities
        digest = hashlib.sha256(json.dumps({
            "model_type": self.spec.model_type, "hidden": self.spec.hidden_size, "layers": self.spec.num_layers,
            "vocab": self.spec.vocab_size, "max_length": self.tokenizer.max_length, "pooling": self.post.pooling,
            "normalize": self.post.normalize, "task": self.task,
            "heads": [h.name for h in self.heads.heads] if self.heads is not None else [], "dtype": caps.dtype, "device_kind": caps.device.split(":")[0],
        }, sort_keys=True).encode())
        update_sampled(digest, self.spec.path, ("model.safetensors", "pytorch_model.bin", "tokenizer.json",
                                                "config.json"))
        return digest.hexdigest()[:16]

    def make_batch(self, items: list[Encoded]) -> TokenBatch:
        if self.layout is Layout.PACKED:
            return TokenBatch.pack(items)
        return TokenBatch.pad(items, pad_id=self.tokenizer.pad_id)

    def compute(self, items: list[Encoded]) -> np.ndarray:
        """Pooled, unnormalized float32 vectors, one row per item, in order."""
        batch = self.make_batch(items)
        if self.engine_heads:
            rows = self.engines.run_heads(batch)
            if rows.shape[0] != len(items):
                raise EngineError(f"engine returned {rows.shape[0]} rows for a batch of {len(items)}")
            return rows
        hidden = self.engines.run(batch)
        if self.engine_pools:
            if hidden.shape[0] != len(items):
                raise EngineError(f"engine returned {hidden.shape[0]} rows for a batch of {len(items)}")
            return hidden
        if self.heads is not None:  # every head of the model from this one backbone pass
            rows = self.heads.apply(hidden, batch)
            if rows.shape[0] != len(items):
                raise EngineError(f"engine returned {rows.shape[0]} rows for a batch of {len(items)}")
            return rows
        vectors = pool(hidden, batch, self.post.pooling)
        if vectors.shape[0] != len(items):
            # Never hand anyone a row that belongs to another request.
            raise EngineError(f"engine returned {vectors.shape[0]} rows for a batch of {len(items)}")
        return vectors

    @property
    def can_return_tokens(self) -> bool:
        """Whether `token_states` can run here: engines in this process (not a --workers front end's remote
        ones) that return the hidden state, or that pool in their graph but can run without pooling
        (TorchEngine.run_hidden); not engines that run the heads in their graph, nor a task graph's logits."""
        engines = getattr(self.engines, "engines", [])
        if not engines or self.engine_heads or any(getattr(e, "logits", False) for e in engines):
            return False
        return not self.engine_pools or all(hasattr(e, "run_hidden") for e in engines)

    def token_states(self, items: list[Encoded]) -> list[np.ndarray]:
        """Each item's last hidden state [n_tokens, hidden] float32, unpooled (TEI's /embed_all). Blocking.
        One item per engine run: its rows are computed from its own tokens only, never padded to (or packed
        with) another input's, so they are the same whatever else the request holds; per-token answers are
        bounded (runtime/token_states.py), and an unpadded run costs no padding either."""
        out: list[np.ndarray] = []
        for item in items:
            batch = self.make_batch([item])
            if self.engine_pools:  # the graphs pool: the engine's own unpooled run, outside the pool's checkout
                engines = self.engines.engines
                hidden = engines[next(self._hidden_turn) % len(engines)].run_hidden(batch)
            else:
                hidden = self.engines.run(batch)
            hidden = np.asarray(hidden, dtype=np.float32)
            rows = hidden[:len(item)] if batch.layout is Layout.PACKED else hidden[0, :len(item)]
            width = self.engines.capabilities.hidden_size or hidden.shape[-1]  # 0: the manifest did not say
            if rows.shape[0] != len(item) or hidden.shape[-1] != width:
                raise EngineError(f"engine returned hidden states of shape {hidden.shape} for one input of "
                                  f"{len(item)} tokens")
            out.append(np.ascontiguousarray(rows))
        return out

    def compute_launch(self, items: list[Encoded]):
        """compute() in two halves (can_launch): this one returns once the batch is on the GPU."""
        batch = self.make_batch(items)
        return len(items), self.engines.launch(batch)

    @staticmethod
    def compute_wait(pending) -> None:
        """Blocks (without the GIL) until the launched batch is done: the only part off the loop."""
        pending[1][1].wait()

    @staticmethod
    def compute_ready(pending) -> bool:
        """Whether the launched batch is done, without blocking (a CUDA event query)."""
        return pending[1][1].ready()

    def compute_collect(self, pending) -> np.ndarray:
        n, token = pending
        rows = self.engines.collect(token)
        if rows.shape[0] != n:
            raise EngineError(f"engine returned {rows.shape[0]} rows for a batch of {n}")
        return rows

    def finish(self, vectors: np.ndarray, options: EmbedOptions) -> np.ndarray:
        """Apply per-request options to pooled vectors."""
        if self.heads is not None:  # rows of every head: the embedding head's pooled vectors
            vectors = self.heads.embed_rows(vectors)
        out = vectors
        if options.dimensions is not None:
            out = out[:, : options.dimensions]
        normalize = self.post.normalize if options.normalize is None else options.normalize
        if normalize:
            out = l2_normalize(out)
        return np.ascontiguousarray(out, dtype=np.float32)
