"""The shared Redis tier is an optimization, never a dependency: a value the server cannot read back
(another surge release's layout, a truncated write, another program's bytes under the same key) is
a miss, computed again and answered 200, never a 500 for every repeat of that input until its TTL.

Real `surge serve` processes, a real redis-server (tests/redis_server.py), real clients.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import redis

from surge.runtime.cache import key_hash
from surge.types import EmbedOptions
from tests.server_process import ServerProcess

MODEL = "all-MiniLM-L6-v2"


def wait_for_keys(client: redis.Redis, pattern: str, n: int, timeout: float = 60.0) -> list[bytes]:
    """The keys matching `pattern`, once there are `n` (the server fills the tier off the response's path)."""
    deadline = time.monotonic() + timeout
    while True:
        keys = sorted(client.scan_iter(pattern))
        if len(keys) >= n or time.monotonic() > deadline:
            return keys
        time.sleep(0.02)


@pytest.fixture
def tier(redis_server):
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    yield redis_server, client
    client.close()


def test_an_unreadable_embedding_value_is_a_miss(tier):
    url, client = tier
    # --cache-bytes 1: no local entry fits, so every repeat asks the shared tier
    with ServerProcess("--redis-url", url, "--cache-bytes", "1", "--threads", "1") as srv:
        text = "the shared tier may hold anything"  # as the model's normalizer leaves it
        body = {"inputs": [text]}
        first = httpx.post(srv.url + "/embed", json=body, timeout=60)
        assert first.status_code == 200
        digest = key_hash((EmbedOptions().key(), text)).hexdigest()
        (key,) = wait_for_keys(client, f"surge:{MODEL}:*{digest}", 1)
        for junk in (b"\x05\x00\x00\x00abcdefg", b"\x05\x00\x00\x00" + b"\x00" * 40):  # misaligned; wrong width
            client.set(key, junk)
            again = httpx.post(srv.url + "/embed", json=body, timeout=60)
            assert again.status_code == 200, again.text
            np.testing.assert_allclose(again.json()["embeddings"], first.json()["embeddings"], atol=1e-6)


def test_an_unreadable_generation_value_is_a_miss(tier, tmp_path):
    pytest.importorskip("torch")
    from tests.decoder_models import build_model

    url, client = tier
    model_dir = build_model("qwen2", tmp_path / "chat-qwen", seed=4, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    # cache_entries=1: the second answer pushes the first out of the local cache, so its repeat asks Redis
    with ServerProcess(str(model_dir), "--redis-url", url, "--generation", "cache_entries=1",
                       "--threads", "1") as srv:
        def complete(prompt: str):
            return httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": "chat-qwen", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})

        first = complete("Names are bound")
        assert first.status_code == 200
        assert len(wait_for_keys(client, "surge:chat-qwen:*", 1)) == 1
        assert complete("Values are boxed").status_code == 200
        keys = wait_for_keys(client, "surge:chat-qwen:*", 2)
        assert len(keys) == 2
        for junk in (b"not json", b'[{"text": "x", "a_field_of_another_release": 1}]', b"[]"):
            for key in keys:
                client.set(key, junk)
            again = complete("Names are bound")
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
            complete("Values are boxed")  # pushes it out of the local cache again
