"""cli/workers_repo.ModelSlots over a real registry and real services (the bundled model): slots follow
the registry, a replaced build's requests go to its successor, the catalog lists what is served, and
the engine server never answers one model's request with another's rows."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from surge.cli.workers_repo import ModelSlots
from surge.errors import NotFound
from surge.runtime import ipc
from surge.runtime.registry import ModelRegistry
from surge.runtime.served import ServedModel
from surge.runtime.service import ModelService


class _Repo:
    def model_names(self):
        return ["enc", "other"]


def test_slots_follow_the_registry_and_replaced_builds_go_to_their_successor(bundled_worker, sentences):
    async def main():
        reg = ModelRegistry()
        slots = ModelSlots(reg, _Repo())
        changes = []
        slots.on_change = lambda: changes.append(1)
        v1 = ServedModel(ModelService("enc", "1", bundled_worker))
        other = ServedModel(ModelService("other", "1", bundled_worker))
        reg.add(v1)
        reg.add(other)
        cat = slots.catalog()
        by = {(m["name"], m["version"]): m["slot"] for m in cat["models"]}
        assert set(by) == {("enc", "1"), ("other", "1")} and len(set(by.values())) == 2 and cat["names"] == ["enc", "other"]
        s1 = by[("enc", "1")]
        assert slots.batcher(s1) is v1.service.batcher
        rebuilt = ServedModel(ModelService("enc", "1", bundled_worker))  # a reload: same name and version
        reg.add(rebuilt)
        await v1.service.batcher.close()
        s2 = {(m["name"], m["version"]): m["slot"] for m in slots.catalog()["models"]}[("enc", "1")]
        assert s2 != s1 and slots.batcher(s1) is rebuilt.service.batcher  # the old slot's traffic moved
        v2 = ServedModel(ModelService("enc", "2", bundled_worker))
        reg.add(v2)
        reg.remove("enc", "1")  # version 1 retired: its slots go to the model's newest version
        assert slots.batcher(s1) is v2.service.batcher and slots.batcher(s2) is v2.service.batcher
        assert slots.batcher(by[("other", "1")]) is other.service.batcher
        reg.remove("enc", "2")
        with pytest.raises(NotFound):
            slots.batcher(s1)
        with pytest.raises(NotFound):
            slots.batcher(999)
        assert [m["name"] for m in slots.catalog()["models"]] == ["other"] and changes
        for s in (rebuilt, v2, other):
            await s.service.batcher.close()

    asyncio.run(main())


def test_the_engine_server_sends_each_slots_requests_to_its_own_model(bundled_worker, sentences):
    """Two models with different outputs behind one engine server: the same tokens, sent to each
    slot interleaved, come back as each model's own rows."""
    from surge.runtime.batcher import BatcherConfig, DynamicBatcher

    items = bundled_worker.tokenizer.encode(sentences[:4])
    pool = ThreadPoolExecutor(1)
    scale = {"a": 1.0, "b": -2.0}

    class _Svc:
        task = "embed"

        def __init__(self, name):
            self.name, self.version = name, "1"
            k = scale[name]
            self.batcher = DynamicBatcher(lambda it: bundled_worker.compute(it) * k, pool, BatcherConfig())

    async def main():
        reg = ModelRegistry()
        slots = ModelSlots(reg, _Repo())
        a, b = ServedModel(_Svc("a")), ServedModel(_Svc("b"))
        reg.add(a)
        reg.add(b)
        sa, sb = slots._slot_of[id(a)], slots._slot_of[id(b)]
        server = ipc.EngineServer(None, {}, models=slots)
        futs = [server.enqueue(items, None, 0, {}, slot) for slot in (sa, sb, sa, sb)]  # one batch's worth
        out = [await f for f in futs]
        for s in (a, b):
            await s.service.batcher.close()
        return out

    ra, rb, ra2, rb2 = asyncio.run(main())
    pool.shutdown()
    base = bundled_worker.compute(items)
    for rows in (ra, ra2):
        np.testing.assert_allclose(rows, base, atol=2e-5, rtol=0)
    for rows in (rb, rb2):
        np.testing.assert_allclose(rows, -2.0 * base, atol=4e-5, rtol=0)


def test_retired_slots_are_bounded_and_the_latest_still_resolve(bundled_worker):
    from concurrent.futures import ThreadPoolExecutor as _Pool

    from surge.runtime.batcher import BatcherConfig, DynamicBatcher

    pool = _Pool(1)

    class _Svc:
        task, name, version = "embed", "m", "1"

        def __init__(self):
            self.batcher = DynamicBatcher(bundled_worker.compute, pool, BatcherConfig())

    reg = ModelRegistry()
    slots = ModelSlots(reg, _Repo())
    seen = []
    for _ in range(5000):  # 5,000 reloads of one version
        s = ServedModel(_Svc())
        reg.add(s)
        seen.append(slots._slot_of[id(s)])
    pool.shutdown()
    assert len(slots._retired) <= 4096
    newest = reg.get("m", "1")
    assert slots.batcher(seen[-2]) is newest.service.batcher  # a batch for the build just replaced
    with pytest.raises(NotFound):
        slots.batcher(seen[0])  # long forgotten: a clear 404, not another build
