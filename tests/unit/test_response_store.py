"""runtime/response_store.py: the Responses API's stored answers, in memory and as files shared by
processes (the --workers front ends)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from surge.config import ResponsesConfig
from surge.runtime.response_store import DirStore, MemoryStore, RedisStore, store_for, valid_id
from tests.redis_server import redis_server  # noqa: F401  (fixture)


def run(coro):
    return asyncio.run(coro)


def record(k: int) -> dict:
    return {"response": {"id": f"resp_{k}", "status": "completed", "output": [{"text": "é" * k}]}, "k": k}


@pytest.fixture(params=["memory", "dir", "redis"])
def make_store(request, tmp_path):
    if request.param == "memory":
        return lambda: MemoryStore(4, 3600)
    if request.param == "dir":
        return lambda: DirStore(tmp_path / "s", 4, 3600)
    url = request.getfixturevalue("redis_server")
    return lambda: RedisStore(url, 4, 3600)


def test_put_get_delete(make_store):
    async def main():
        store = make_store()  # a Redis client belongs to its event loop
        for k in range(3):
            await store.put(f"resp_{k}", record(k))
        assert [await store.get(f"resp_{k}") for k in range(3)] == [record(k) for k in range(3)]
        assert await store.get("resp_9") is None
        assert await store.delete("resp_1") and await store.get("resp_1") is None and not await store.delete("resp_1")
        await store.put("resp_2", {**record(2), "cancel_requested": True})  # a write replaces the record
        assert (await store.get("resp_2"))["cancel_requested"] is True
        for bad in ("../x", "a/b", ""):
            assert await store.get(bad) is None and not await store.delete(bad)
            with pytest.raises(ValueError):
                await store.put(bad, record(1))
    run(main())


def test_memory_keeps_the_recently_used_and_forgets_the_old():
    s = MemoryStore(3, 3600)
    for k in range(3):
        run(s.put(f"r{k}", record(k)))
    run(s.get("r0"))  # used: the oldest in use is now r1
    run(s.put("r3", record(3)))
    assert run(s.get("r1")) is None and all(run(s.get(f"r{k}")) for k in (0, 2, 3))
    old = MemoryStore(3, 0.05)
    run(old.put("r", record(1)))
    time.sleep(0.1)
    assert run(old.get("r")) is None
    none = MemoryStore(0, 3600)
    run(none.put("r", record(1)))
    assert run(none.get("r")) is None


def test_files_are_pruned_by_count_and_age(tmp_path):
    s = DirStore(tmp_path, 3, 3600)
    now = time.time()
    for k in range(6):
        run(s.put(f"r{k}", record(k)))
        os.utime(tmp_path / f"r{k}.json", (now - 100 + k, now - 100 + k))  # r0 the oldest
    s.prune()
    assert [run(s.get(f"r{k}")) is not None for k in range(6)] == [False, False, False, True, True, True]
    os.utime(tmp_path / "r5.json", (now - 7200, now - 7200))
    assert run(s.get("r5")) is None and not (tmp_path / "r5.json").exists()  # past its time: gone on read
    assert not list(tmp_path.glob(".*.tmp"))
    (tmp_path / "r4.json").write_text("{torn")
    assert run(s.get("r4")) is None  # unreadable: a miss, never an error


def test_an_id_is_never_a_path(tmp_path):
    s = DirStore(tmp_path / "s", 3, 3600)
    for bad in ("../x", "a/b", "", ".hidden/..", "x" * 200):
        assert not valid_id(bad)
        assert run(s.get(bad)) is None and not run(s.delete(bad))
        with pytest.raises(ValueError):
            run(s.put(bad, record(1)))
    assert valid_id("resp_0123abc") and valid_id("msg-1")


def test_another_process_reads_what_one_wrote_and_writes_over_it(tmp_path):
    s = DirStore(tmp_path, 10, 3600)
    run(s.put("resp_a", record(2)))
    code = ("import sys, json, asyncio; from surge.runtime.response_store import DirStore\n"
            "async def main():\n"
            "    s = DirStore(sys.argv[1], 10, 3600); a = await s.get('resp_a'); print(json.dumps(a))\n"
            "    await s.put('resp_b', {'from': 'child'}); await s.put('resp_a', {**a, 'cancel_requested': True})\n"
            "asyncio.run(main())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    import json

    assert json.loads(out.stdout) == record(2)
    assert run(s.get("resp_b")) == {"from": "child"} and run(s.get("resp_a"))["cancel_requested"] is True


def test_the_server_picks_its_store(tmp_path, monkeypatch):
    monkeypatch.delenv("SURGE_SHM_DIR", raising=False)
    assert isinstance(store_for(ResponsesConfig()), MemoryStore)
    monkeypatch.setenv("SURGE_SHM_DIR", str(tmp_path))
    shared = store_for(ResponsesConfig())
    assert isinstance(shared, DirStore) and shared.root == tmp_path / "responses"
    mine = store_for(ResponsesConfig(store_dir=tmp_path / "mine", store_entries=7))
    assert isinstance(mine, DirStore) and mine.root == tmp_path / "mine" and mine.entries == 7
    redis_store = store_for(ResponsesConfig(store_dir=tmp_path / "mine", store_redis_url="redis://127.0.0.1:1/0"))
    assert isinstance(redis_store, RedisStore)


def test_memory_and_files_keep_at_most_max_bytes():
    """Session 46: the stores counted records only, so 10,000 responses of 2 MB request bodies (reasoning items
    are kept whole) stayed in memory, or in the --workers front ends' shared memory. Past `max_bytes` of JSON
    the least recently used leave; a record larger than all of it is not kept (nor an older state of it)."""
    import orjson

    big = lambda k: {**record(0), "pad": "x" * 4000, "k": k}  # noqa: E731 - one size
    size = len(orjson.dumps(big(0)))
    s = MemoryStore(100, 3600, max_bytes=3 * size)
    for k in range(5):
        run(s.put(f"r{k}", big(k)))
    assert [run(s.get(f"r{k}")) is not None for k in range(5)] == [False, False, True, True, True]
    assert s.bytes == 3 * size
    run(s.put("r4", {**big(4), "pad": "x" * 20_000}))  # grew past the bound: not kept, its old state gone
    assert run(s.get("r4")) is None and s.bytes == 2 * size
    assert run(s.delete("r3")) and s.bytes == size


def test_files_are_pruned_by_bytes(tmp_path):
    import orjson

    big = lambda k: {**record(0), "pad": "x" * 4000, "k": k}  # noqa: E731 - one size
    size = len(orjson.dumps(big(0)))
    s = DirStore(tmp_path, 100, 3600, max_bytes=3 * size)
    now = time.time()
    for k in range(5):
        run(s.put(f"r{k}", big(k)))
        os.utime(tmp_path / f"r{k}.json", (now - 100 + k, now - 100 + k))  # r0 the oldest
    s.prune()
    assert [run(s.get(f"r{k}")) is not None for k in range(5)] == [False, False, True, True, True]
    run(s.put("r4", {**big(4), "pad": "x" * 20_000}))
    assert run(s.get("r4")) is None and not (tmp_path / "r4.json").exists()
