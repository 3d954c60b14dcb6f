"""The health check of a decoder model's Ray Serve replica (distributed/generate_replica.py), built
in-process as ray_serve.py's deployment builds it (the check is plain Python; Ray only calls it).

Ray replaces a replica whose check raises or times out a few times in a row, killing every stream on
it. A replica whose engine is busy and making progress must pass, even when its queue is full (its own
probe would be refused with 429, or wait behind every queued request); an idle replica still runs the
probe through the engine.
"""

from __future__ import annotations

import asyncio
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.decoder_models import build_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("rh") / "q", seed=3)


def _replica(model_dir):
    from surge.config import BatchingConfig, CacheConfig, EngineConfig, GenerationConfig, LimitsConfig
    from surge.distributed.generate_replica import GenerateReplica
    from surge.distributed.replica import ReplicaSpec

    gen = GenerationConfig(max_num_seqs=1, max_waiting=2, max_model_len=256, kv_cache_tokens=1024, block_size=4,
                           cache_entries=0)
    spec = ReplicaSpec("q", "1", model_dir, None, EngineConfig(threads=1), BatchingConfig(), CacheConfig(),
                       LimitsConfig(request_timeout_s=120), task="generate", generation=gen)
    return GenerateReplica(spec)


def test_a_replica_with_a_full_queue_is_healthy(model_dir):
    from surge.errors import Overloaded
    from surge.runtime.scheduler import SamplingParams

    replica = _replica(model_dir)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def main():
        await replica.info()  # the first probe: what a healthy engine answers
        await replica.check_health()  # idle: the probe runs
        prompt = replica.service.encode("Names")
        # in one event-loop pass, in this order: two requests fill the queue (max_waiting 2), then Ray's
        # check and a third client request arrive
        clients = [asyncio.ensure_future(replica.generate(prompt, long)) for _ in range(2)]
        health = asyncio.ensure_future(replica.check_health())
        third = asyncio.ensure_future(replica.generate(prompt, long))
        with pytest.raises(Overloaded):  # a client is refused: the queue is full
            await third
        try:
            await health  # ...but the replica is healthy: its own probe is no client of that queue
            done = await asyncio.gather(*clients)
        finally:
            await replica.close()
        return done

    done = asyncio.run(main())
    assert [len(r.token_ids) for r, _ in done] == [100, 100]
