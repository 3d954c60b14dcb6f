"""Replicas over devices: the least-loaded dispatcher with real engines standing in for GPUs.

CPU torch engines (the bundled MiniLM, FP32) are labelled as devices; every
result is checked against the same batch run alone, so a mixed-up row fails.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from surge.config import EngineConfig
from surge.engines.torch_gpu import TorchEngine
from surge.errors import EngineError
from surge.runtime.devices import DevicePool
from surge.types import TokenBatch


@pytest.fixture(scope="module")
def tokenizer(bundled_spec):
    from surge.runtime.tokenize import Tokenizer

    return Tokenizer(bundled_spec.tokenizer_file, bundled_spec.max_length, bundled_spec.vocab_size,
                     bundled_spec.pad_token_id)


def _engines(spec, n: int) -> list[TorchEngine]:
    out = []
    for _ in range(n):
        e = TorchEngine(device="cpu", precision="fp32", max_batch=64)
        e.load(spec.path)
        out.append(e)
    return out


@pytest.fixture(scope="module")
def reference(bundled_spec):
    return _engines(bundled_spec, 1)[0]


def _wait_until(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_every_batch_gets_its_own_rows_and_both_devices_work(bundled_spec, tokenizer, reference, sentences):
    pool = DevicePool(_engines(bundled_spec, 2), ["dev0", "dev1"])
    rng = np.random.default_rng()
    batches = []
    for _ in range(9):
        picks = rng.choice(len(sentences), int(rng.integers(1, 9)), replace=False)
        batches.append(TokenBatch.pack(tokenizer.encode([sentences[i] for i in picks])))
    results: dict[int, np.ndarray] = {}

    def client(indices):
        for i in indices:
            results[i] = pool.run(batches[i])

    threads = [threading.Thread(target=client, args=(range(k, 9, 3),)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i, b in enumerate(batches):
        np.testing.assert_allclose(results[i], reference.run(b), rtol=1e-5, atol=1e-5)
    stats = pool.stats()
    assert [s["device"] for s in stats] == ["dev0", "dev1"]
    assert sum(s["served_batches"] for s in stats) == 9 and all(s["served_batches"] > 0 for s in stats)
    assert all(s["inflight_batches"] == 0 and s["inflight_tokens"] == 0 for s in stats)


def test_sequential_traffic_alternates(bundled_spec, tokenizer, sentences):
    pool = DevicePool(_engines(bundled_spec, 2), ["dev0", "dev1"])
    batch = TokenBatch.pack(tokenizer.encode(sentences[:2]))
    for _ in range(6):
        pool.run(batch)
    assert [s["served_batches"] for s in pool.stats()] == [3, 3]


def test_a_busy_device_is_passed_over_by_inflight_tokens(bundled_spec, tokenizer, reference, sentences):
    """Two instances per device: dev0 still has a free instance, but its in-flight tokens send work to dev1."""
    engines = _engines(bundled_spec, 4)
    pool = DevicePool(engines, ["dev0", "dev0", "dev1", "dev1"])
    big = TokenBatch.pack(tokenizer.encode([" ".join(sentences[i:i + 12]) for i in range(0, 24 * 12, 12)]))
    holder = threading.Thread(target=pool.run, args=(big,))
    holder.start()  # ties go to the first device: the big batch runs on dev0
    _wait_until(lambda: pool.stats()[0]["inflight_batches"] == 1)
    small = [TokenBatch.pack(tokenizer.encode(sentences[i:i + 2])) for i in range(0, 6, 2)]
    outs = [pool.run(b) for b in small]
    busy_during = pool.stats()[0]["inflight_batches"]
    holder.join()
    stats = pool.stats()
    if busy_during == 1:  # the big batch outlasted the small ones (it always should): none of them went to dev0
        assert stats[0]["served_batches"] == 1 and stats[1]["served_batches"] == 3
    assert stats[0]["served_tokens"] == big.real_tokens
    for b, o in zip(small, outs):
        np.testing.assert_allclose(o, reference.run(b), rtol=1e-5, atol=1e-5)


def test_an_engine_error_frees_its_device(bundled_spec, tokenizer, sentences):
    from surge.errors import InvalidInput

    pool = DevicePool(_engines(bundled_spec, 1), ["dev0"])
    bad = TokenBatch.pack(tokenizer.encode(sentences[:1]))
    bad.input_ids[0] = 10 ** 7
    with pytest.raises(InvalidInput):
        pool.run(bad)
    assert pool.stats()[0]["inflight_batches"] == 0
    assert pool.run(TokenBatch.pack(tokenizer.encode(sentences[:1]))).shape[1] == 384


def test_config_validation():
    with pytest.raises(ValueError, match="engine: torch"):
        EngineConfig(devices=[0, 1])
    with pytest.raises(ValueError, match="tensor_parallel 2 needs"):
        EngineConfig(engine="torch", tensor_parallel=2, devices=[0, 1, 2])
    with pytest.raises(ValueError, match="non-empty"):
        EngineConfig(engine="torch", devices=[])
    with pytest.raises(ValueError, match="distinct"):
        EngineConfig(engine="torch", tensor_parallel=2, devices=[0, 0])
    with pytest.raises(ValueError, match="instances"):
        EngineConfig(engine="torch", tensor_parallel=2, instances=2)
    assert EngineConfig(engine="torch", devices=[0, 0, 1]).devices == [0, 0, 1]  # replicas may share a GPU


def test_devices_without_cuda_is_a_clear_error(bundled_spec):
    import torch

    from surge.runtime.loader import make_engines

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(EngineError, match="no CUDA GPU"):
        make_engines(EngineConfig(engine="torch", devices=[0, 1]), bundled_spec, None)


@pytest.mark.cuda
def test_replicas_on_gpus_through_the_loader(bundled_spec, reference_embed, sentences):
    import torch

    from surge.engines.pooling import l2_normalize
    from surge.runtime.loader import build_worker
    from tests.conftest import cosine_rows

    devices = list(range(torch.cuda.device_count())) * (2 if torch.cuda.device_count() == 1 else 1)
    worker = build_worker(bundled_spec, None, EngineConfig(engine="torch", device="cuda", precision="fp16",
                                                           devices=devices))
    assert isinstance(worker.engines, DevicePool) and len(worker.engines.engines) == len(devices)
    texts = sentences[:64]
    vecs = np.concatenate([worker.compute(worker.tokenizer.encode(texts[i:i + 8])) for i in range(0, 64, 8)])
    assert cosine_rows(l2_normalize(vecs), reference_embed(texts)).min() >= 0.999
    assert all(s["served_batches"] > 0 for s in worker.engines.stats())
    worker.engines.close()


def test_per_device_load_is_exported_on_metrics(bundled_spec, tokenizer, reference, sentences):
    """A ModelService over a DevicePool reports each device's batches, tokens and instances; a retired version's
    device series go away."""
    import asyncio

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from surge.config import BatchingConfig, CacheConfig
    from surge.engines.pooling import l2_normalize, pool as pool_tokens
    from surge.runtime.service import ModelService
    from surge.runtime.worker import ModelWorker, PostSpec

    pool = DevicePool(_engines(bundled_spec, 3), ["dev0", "dev0", "dev1"])
    worker = ModelWorker(bundled_spec, tokenizer, pool, PostSpec(bundled_spec.pooling, bundled_spec.normalize))
    reg = CollectorRegistry()
    rng = np.random.default_rng()
    texts = [sentences[i] for i in rng.choice(len(sentences), 24, replace=False)]

    def scrape() -> dict:
        out = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                if s.name.startswith("surge_device_"):
                    out[(s.name, s.labels["device"])] = (s.value, s.labels["model"], s.labels["version"])
        return out

    async def main():
        svc = ModelService(bundled_spec.name, "7", worker, batching=BatchingConfig(max_batch_size=4, max_queue_delay_ms=2),
                           cache=CacheConfig(enabled=False), metrics_registry=reg)
        svc.mark_ready()
        results = await asyncio.gather(*(svc.embed(texts=texts[i:i + 2]) for i in range(0, len(texts), 2)))
        during = scrape()
        await svc.close()
        return results, during

    results, during = asyncio.run(main())
    stats = {s["device"]: s for s in pool.stats()}
    assert stats["dev0"]["served_batches"] + stats["dev1"]["served_batches"] >= 6  # 24 inputs, at most 4 a batch
    for dev in ("dev0", "dev1"):
        assert during[("surge_device_batches_total", dev)][0] == stats[dev]["served_batches"]
        assert during[("surge_device_tokens_total", dev)][0] == stats[dev]["served_tokens"]
        assert during[("surge_device_inflight_batches", dev)][0] == 0
        assert during[("surge_device_batches_total", dev)][1:] == (bundled_spec.name, "7")
    assert during[("surge_device_instances", "dev0")][0] == 2 and during[("surge_device_instances", "dev1")][0] == 1
    assert not scrape(), "a closed service's device series are dropped"
    got = np.concatenate([r.vectors for r in results])  # request order; every row its own text's
    batch = TokenBatch.pack(tokenizer.encode(texts))
    want = l2_normalize(pool_tokens(reference.run(batch), batch, "mean"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
