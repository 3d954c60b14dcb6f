"""The generation cache is bounded in bytes, not only in entries (runtime/generate_service.py, `cache_bytes`).

Its key holds the request's prompt and sampling fields, its value the answer's deltas (log-probabilities of the
prompt's tokens included): one entry can hold megabytes (a request of 100,000 bad words is ~6 MB of tuples), so
`cache_entries` (1024) alone let clients make the cache hold gigabytes. Measured here as what the entries' objects
take (sys.getsizeof over everything they reach), against a real service on the tiny Qwen2 model; failed before
the fix (every entry kept: ~190 MB)."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry

from surge.config import GenerationConfig
from surge.runtime.scheduler import SamplingParams
from tests.decoder_models import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("m") / "q", seed=3)


def _service(path, **gen):
    from tokenizers import Tokenizer

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService

    torch.set_num_threads(1)
    engine = DecoderEngine(path, num_blocks=256, block_size=4, max_num_seqs=8, max_model_len=128)
    config = GenerationConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128, **gen)
    s = GenerateService("m", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")), None, config,
                        request_timeout_s=60, metrics_registry=CollectorRegistry())
    s.mark_ready()
    return s


def deep_size(root) -> int:
    """Bytes of every object reachable from `root` (each counted once)."""
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def test_the_generation_cache_holds_at_most_its_byte_bound(model_dir):
    service = _service(model_dir)  # the defaults: cache_entries 1024, cache_bytes as documented
    bound = GenerationConfig().cache_bytes if "cache_bytes" in GenerationConfig.model_fields else 0
    prompt = service.encode("The augmented assignment")
    words = 100_000  # one-token bad words: ~2 x 100,000 characters in a request's body

    async def main():
        for i in range(30):  # each a greedy request of its own (the cache's key differs): each kept
            bad = tuple((t,) for t in [5] * (words - 1)) + ((6 + i,),)  # a tuple per word, as parsed
            await service.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, bad_words_ids=bad))
        # the last answer was kept: the cache still works
        again = await service.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, bad_words_ids=bad))
        return again

    try:
        again = asyncio.run(main())
        held = deep_size(list(service._cache.items()))
    finally:
        asyncio.run(service.close())
    assert again.cached
    assert 0 < held <= bound, f"the generation cache holds {held / 2**20:.0f} MiB (bound: {bound / 2**20:.0f} MiB)"
