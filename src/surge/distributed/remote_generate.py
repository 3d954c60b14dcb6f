"""A decoder model served by Ray Serve replicas, as the ingress's registry sees it.

It implements what the generation routes use of a local GenerateService (the served-model
protocol for task generate): the text side locally (tokenizer and chat template, sent by a
replica at connect: no round trip per request), `generate` and `stream` on a replica.
A stream is a Ray streaming call; closing it (client gone) cancels the replica's generator,
which aborts the sequence and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import AsyncIterator

from surge.distributed.ingress import _LOST, _served, ray_error
from surge.errors import WrongTask
from surge.runtime.generate_text import PromptText

log = logging.getLogger("surge.distributed")


def _time_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class RemoteGenerateModel(PromptText):
    """Stands in for a GenerateService in the ingress's registry; the work runs on a replica."""

    task = "generate"
    kind = "hf"

    def __init__(self, name: str, version: str, handle, retries: int = 1):
        self.name = name
        self.version = version
        self.handle = handle
        self.retries = retries
        self.ready = False
        self.loaded_at = time.time()
        self.tokenizer = None
        self.chat_template = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.config = None
        self.sampling_defaults: dict = {}
        self.architecture: str | None = None
        self._metadata: dict = {}
        # the replicas' LoRA adapters (each replica loads the configured ones), served under their names
        self.adapters: dict = {}
        self.views: list = []
        self.runtime_adapters = False  # a load would reach one replica of several

    async def connect(self) -> None:
        """Learn the model's tokenizer, template and settings from a replica (waits until one is up)."""
        from tokenizers import Tokenizer

        from surge.config import GenerationConfig

        info = await self.handle.info.remote()
        self.tokenizer = Tokenizer.from_str(info["tokenizer"])
        self.chat_template = info["chat_template"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.config = GenerationConfig.model_validate(info["config"])
        self.sampling_defaults = info.get("sampling_defaults") or {}
        self.architecture = info.get("architecture")
        self._metadata = info["metadata"]
        self.loaded_at = info["loaded_at"]
        from surge.runtime.lora_adapters import Adapter, AdapterView

        self.adapters = {a["name"]: Adapter(a["name"], Path(a["path"]), a["digest"]) for a in info.get("adapters", ())}
        self.views = [AdapterView(self, a) for a in self.adapters.values()]
        self.ready = True

    def mark_ready(self) -> None:
        self.ready = True

    def kserve_metadata(self, versions: list[str]) -> dict:
        return {**self._metadata, "versions": versions}

    async def embed(self, *args, **kwargs):
        raise WrongTask(f"model '{self.name}' serves task 'generate', not 'embed'", param="model")

    async def generate(self, prompt_ids: list[int], params, *, deadline: float | None = None,
                       adapter: str | None = None):
        for attempt in range(self.retries + 1):
            response = self.handle.generate.remote(list(prompt_ids), params, _time_left(deadline), adapter)
            try:
                result, replica = await response
            except asyncio.CancelledError:  # the client left: stop the replica's work too
                response.cancel()
                raise
            except Exception as exc:
                if self._lost(exc, attempt):
                    continue
                raise self._error(exc) from None
            self._record(replica, result.cached)
            return result
        raise AssertionError("unreachable")

    async def stream(self, prompt_ids: list[int], params, *, deadline: float | None = None,
                     adapter: str | None = None) -> AsyncIterator:
        for attempt in range(self.retries + 1):
            gen = self.handle.options(stream=True).stream.remote(list(prompt_ids), params, _time_left(deadline),
                                                                 adapter)
            started = finished = False
            try:
                async for delta, replica in gen:
                    if not started:
                        started = True
                        self._record(replica, delta.cached)
                    yield delta
                finished = True
                return
            except Exception as exc:
                if not started and self._lost(exc, attempt):  # nothing sent yet: another replica may answer
                    continue
                raise self._error(exc) from None
            finally:
                if not finished:
                    gen.cancel()  # cancelled, failed or abandoned: the replica aborts the sequence
        raise AssertionError("unreachable")

    def _lost(self, exc: Exception, attempt: int) -> bool:
        """A replica lost mid-request with retries left: Ray's router has dropped it, retry."""
        if isinstance(exc, _LOST) and attempt < self.retries:
            log.warning("model %s: replica lost mid-request (%s); retrying", self.name, type(exc).__name__)
            return True
        return False

    def _error(self, exc: Exception):
        return ray_error(self.name, exc)

    @staticmethod
    def _record(replica: str, cached: bool) -> None:
        served = _served.get()
        if served is not None:
            served.append((replica, [cached]))

    async def close(self) -> None:
        self.ready = False
