"""One replica per GPU (`devices: [0, 1]`): every row its own sentence's vector, both GPUs used, and the
per-device load on /metrics of a real `surge serve --devices 0,1` process. Needs two GPUs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.conftest import cosine_rows
from tests.gpu.test_torch_engine_cuda import embed

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def test_replicas_over_two_gpus_match_reference(model_dir, tokenizer, reference, sentences):
    from surge.config import EngineConfig
    from surge.models import load_model_spec
    from surge.runtime.devices import DevicePool
    from surge.runtime.loader import make_engines

    spec = load_model_spec(model_dir)
    pool = make_engines(EngineConfig(engine="torch", device="cuda", precision="fp16", devices=[0, 1],
                                     max_batch_size=32), spec, None)
    assert isinstance(pool, DevicePool)
    assert [str(e.device) for e in pool.engines] == ["cuda:0", "cuda:1"]
    rng = np.random.default_rng()
    chunks = [rng.choice(len(sentences), int(rng.integers(1, 33)), replace=False) for _ in range(24)]
    results: dict[int, np.ndarray] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        vecs = embed(pool, tokenizer, [sentences[j] for j in chunks[i]], bs=32)
        with lock:
            results[i] = vecs

    with ThreadPoolExecutor(6) as ex:  # more clients than GPUs: both run at once
        list(ex.map(one, range(len(chunks))))
    got = np.concatenate([results[i] for i in range(len(chunks))])
    cos = cosine_rows(got, reference[np.concatenate(chunks)])
    assert cos.min() >= 0.9999, f"worst {cos.min():.6f}"
    stats = {s["device"]: s for s in pool.stats()}
    assert sum(s["served_batches"] for s in stats.values()) == len(chunks)
    assert stats["cuda:0"]["served_batches"] > 0 and stats["cuda:1"]["served_batches"] > 0, stats
    pool.close()


def test_server_on_two_gpus(model_dir, tokenizer, reference, sentences):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server_process import ServerProcess

    with ServerProcess(str(model_dir), "--engine", "torch", "--device", "cuda", "--precision", "fp16",
                       "--devices", "0,1", "--cache-bytes", "0") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        rng = np.random.default_rng()
        picks = [rng.choice(len(sentences), 8, replace=False) for _ in range(32)]

        def call(idx):
            r = c.post("/v1/embeddings", json={"input": [sentences[j] for j in idx], "model": _model_id(c)})
            assert r.status_code == 200, r.text
            return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)

        with ThreadPoolExecutor(16) as ex:
            got = list(ex.map(call, picks))
        cos = cosine_rows(np.concatenate(got), reference[np.concatenate(picks)])
        assert cos.min() >= 0.9999, f"worst {cos.min():.6f}"
        bad = c.post("/v1/embeddings", json={"input": [[5, 10 ** 9]], "model": _model_id(c)})
        assert 400 <= bad.status_code < 500, bad.text
        batches = {}
        for fam in text_string_to_metric_families(c.get("/metrics").text):
            for s in fam.samples:
                if s.name == "surge_device_batches_total":
                    batches[s.labels["device"]] = s.value
        assert set(batches) == {"cuda:0", "cuda:1"} and min(batches.values()) > 0, batches


def _model_id(c) -> str:
    return c.get("/v1/models").json()["data"][0]["id"]
