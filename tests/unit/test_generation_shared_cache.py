"""runtime/generate_service.py's shared tier of the generation cache: what a replica stores is what another
replays, and which services get the tier."""

from __future__ import annotations

from types import SimpleNamespace

from surge.config import CacheConfig, GenerationConfig
from surge.runtime.generate_service import attach_shared_cache
from surge.runtime.generate_shared import pack, shared_key, unpack
from surge.runtime.generate_delta import Delta
from surge.runtime.scheduler import SamplingParams


def test_deltas_survive_the_trip_and_keys_separate_what_differs():
    deltas = [Delta("Hel", [5, 6], [{"token": "Hel", "logprob": -0.5, "top": [("Hel", -0.5, 5), ("He", -1.2, 7)]}],
                    prompt_tokens=9, prompt_logprobs=[{"token": "a", "logprob": -2.0, "top": None}]),
              Delta("lo", [8], None, "stop", 9, 3, stop_reason="\n\n", cached_tokens=4)]
    back = unpack(pack(deltas))
    assert [(d.text, d.token_ids, d.finish_reason, d.prompt_tokens, d.completion_tokens, d.stop_reason,
             d.cached_tokens) for d in back] == \
        [(d.text, d.token_ids, d.finish_reason, d.prompt_tokens, d.completion_tokens, d.stop_reason,
          d.cached_tokens) for d in deltas]
    top = back[0].logprobs[0]["top"]
    assert [(t, v, i) for t, v, i in top] == [("Hel", -0.5, 5), ("He", -1.2, 7)]  # unpacked as the routes do
    assert back[0].prompt_logprobs == deltas[0].prompt_logprobs and not back[0].cached
    greedy = SamplingParams(max_tokens=4, temperature=0.0).key()
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=3).key()
    keys = {shared_key(k) for k in [("1", (1, 2), greedy), ("2", (1, 2), greedy), ("1", (1, 2, 3), greedy),
                                     ("1", (12,), greedy), ("1", (1, 2), seeded)]}
    assert len(keys) == 5  # versions, prompts (1,2 vs 12) and sampling never share an entry


def test_only_a_server_with_a_redis_url_and_both_caches_on_gets_the_tier():
    caps = SimpleNamespace(device="cpu", dtype="fp32")

    def service(entries=16):
        return SimpleNamespace(config=GenerationConfig(cache_entries=entries), engine=SimpleNamespace(
            capabilities=caps), name="m", version="3", shared=None)

    for cache, entries in ((CacheConfig(), 16), (CacheConfig(redis_url="redis://127.0.0.1:1/0", enabled=False), 16),
                           (CacheConfig(redis_url="redis://127.0.0.1:1/0"), 0), (None, 16)):
        s = service(entries)
        attach_shared_cache(s, cache)
        assert s.shared is None
    s = service()
    attach_shared_cache(s, CacheConfig(redis_url="redis://127.0.0.1:1/0", redis_ttl_s=60))
    assert s.shared.prefix == "surge:m:3:generate:cpu:fp32:" and s.shared.ttl_s == 60
    caps = SimpleNamespace(device="cuda:0", dtype="bfloat16", quantization="fp8")  # FP8 weights answer apart
    s = service()
    attach_shared_cache(s, CacheConfig(redis_url="redis://127.0.0.1:1/0"))
    assert s.shared.prefix == "surge:m:3:generate:cuda:0:bfloat16:fp8:"


def test_the_tier_keys_change_with_the_weights_even_in_their_middle(tmp_path):
    """A version reloaded with other weights (a fine-tune that changed only middle layers: the file's size,
    first and last bytes the same) reads none of the old weights' answers: its shared-tier prefix differs."""
    from surge.runtime.generate_service import weights_fingerprint

    caps = SimpleNamespace(device="cpu", dtype="fp32")
    blob = bytearray(range(256)) * 8192  # 2 MiB
    prefixes = []
    for i, byte in enumerate((0, 1)):
        d = tmp_path / f"v{i}"
        d.mkdir()
        blob[len(blob) // 2] = byte
        (d / "model.safetensors").write_bytes(bytes(blob))
        (d / "tokenizer.json").write_text("{}")
        s = SimpleNamespace(config=GenerationConfig(cache_entries=16), engine=SimpleNamespace(capabilities=caps),
                            name="m", version="1", shared=None, path=d)
        attach_shared_cache(s, CacheConfig(redis_url="redis://127.0.0.1:1/0"))
        assert s.shared.prefix == f"surge:m:1:generate:cpu:fp32:{weights_fingerprint(d)}:"
        prefixes.append(s.shared.prefix)
    assert prefixes[0] != prefixes[1]
    assert weights_fingerprint(tmp_path / "v0") == weights_fingerprint(tmp_path / "v0")  # the same in every process
