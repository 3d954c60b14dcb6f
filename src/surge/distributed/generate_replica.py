"""The body of a decoder model's Ray Serve deployment: one whole GenerateService per
replica (paged KV cache, iteration scheduler, generation cache), built as a single
`surge serve` process builds it (runtime/loader.py), plus Ray's health check.

Its methods are what the ingress's RemoteGenerateModel (distributed/remote_generate.py)
calls: `info`, `generate`, `stream` (a generator: Ray streams its items) and
`check_health`. Plain Python like replica.py; ray_serve.py makes it a deployment.
"""

from __future__ import annotations

import logging
import time

from surge.distributed.replica import PROBE_TEXT, ReplicaSpec, replica_identity
from surge.errors import EngineError
from surge.runtime.scheduler import SamplingParams

log = logging.getLogger("surge.distributed")

# Greedy, EOS ignored, computed even when cached: the probe always reaches the engine.
PROBE_PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def build_generate(spec: ReplicaSpec):
    """The same GenerateService a single `surge serve` process builds (cli/bootstrap.py)."""
    from surge.config import GenerationConfig
    from surge.models import load_model_spec
    from surge.runtime.loader import build_generate_service

    from surge.runtime.generate_service import attach_shared_cache

    model_spec = load_model_spec(spec.model_dir, name=spec.name)
    service = build_generate_service(model_spec, spec.version, spec.engine, spec.limits,
                                     spec.generation or GenerationConfig())
    attach_shared_cache(service, spec.cache)
    return service


class GenerateReplica:
    """One replica of one decoder model version."""

    def __init__(self, spec: ReplicaSpec):
        started = time.perf_counter()
        self.spec = spec
        self.identity = replica_identity()
        self.service = build_generate(spec)
        self.service.mark_ready()
        self._probe_ids = self.service.encode(PROBE_TEXT) or [0]
        self._probe: list[int] | None = None  # the first probe's tokens (generation needs the event loop)
        log.info("replica %s of %s v%s (generate) ready in %.1f s", self.identity, spec.name, spec.version,
                 time.perf_counter() - started)

    def _deadline(self, timeout_s: float | None) -> float | None:
        # The ingress sends the time left, not its clock: replicas may run on other machines.
        return None if timeout_s is None else time.monotonic() + max(timeout_s, 0.0)

    async def info(self) -> dict:
        s = self.service
        await self._check_probe()  # the first call records what a healthy engine answers
        return {"name": s.name, "version": s.version, "task": s.task, "loaded_at": s.loaded_at,
                "replica": self.identity, "max_model_len": s.max_model_len, "vocab_size": s.vocab_size,
                "tokenizer": s.tokenizer.to_str(), "chat_template": s.chat_template,
                "config": s.config.model_dump(), "sampling_defaults": s.sampling_defaults,
                "metadata": s.kserve_metadata([]), "architecture": getattr(s, "architecture", None),
                "adapters": [a.describe() for a in s.adapters.values()]}

    async def generate(self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None,
                       adapter: str | None = None):
        """The service's answer and who computed it (the ingress reports it); `adapter`: a LoRA adapter's name."""
        result = await self.service.generate(prompt_ids, params, deadline=self._deadline(timeout_s), adapter=adapter)
        return result, self.identity

    async def stream(self, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None,
                     adapter: str | None = None):
        """(delta, replica) items; closing the stream (client gone) aborts the sequence."""
        async for delta in self.service.stream(prompt_ids, params, deadline=self._deadline(timeout_s),
                                               adapter=adapter):
            yield delta, self.identity

    async def check_health(self) -> None:
        """Ray calls this periodically; raising makes Ray replace the replica."""
        if not self.service.ready:
            raise EngineError(f"replica {self.identity}: service is not ready")
        await self._check_probe()

    async def _check_probe(self) -> None:
        """A short greedy generation through the engine: it must finish, with ids of the vocabulary,
        and on the CPU (deterministic whatever the batch) equal the first probe's tokens."""
        try:
            # past the queue limit: a replica whose clients fill its queue is busy, not broken, and Ray
            # replaces one whose check fails (every stream on it lost), which would turn load into outages
            res = await self.service.generate(self._probe_ids, PROBE_PARAMS, use_cache=False, queue_limit=False)
        except Exception as exc:
            raise EngineError(f"replica {self.identity}: engine check failed: {type(exc).__name__}: {exc}") from None
        ids = list(res.token_ids)
        if len(ids) != PROBE_PARAMS.max_tokens or not all(0 <= t < self.service.vocab_size for t in ids):
            raise EngineError(f"replica {self.identity}: engine check gave {ids}")
        if self._probe is None:
            self._probe = ids
        elif self.spec.engine.device == "cpu" and ids != self._probe:
            raise EngineError(f"replica {self.identity}: engine check gave {ids}, at startup {self._probe}")

    async def close(self) -> None:
        await self.service.close()
