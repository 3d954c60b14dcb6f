"""`surge serve --engine torch --tensor-parallel 2` on the CPU: a real server whose model is split over two
rank processes (gloo), called over HTTP, checked against transformers FP32 on real sentences."""

from __future__ import annotations

import httpx
import numpy as np
import psutil

from tests.conftest import cosine_rows
from tests.server_process import ServerProcess


def test_served_split_model_matches_reference(reference_embed, sentences):
    with ServerProcess("--engine", "torch", "--tensor-parallel", "2", "--threads", "1", "--cache-bytes", "0") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        ranks = [p for p in psutil.Process(srv.proc.pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1, "one spawned rank process besides the server (rank 0)"
        rng = np.random.default_rng()
        texts = [sentences[i] for i in rng.choice(len(sentences), 12, replace=False)]
        r = c.post("/v1/embeddings", json={"input": texts, "model": "all-MiniLM-L6-v2"})
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        assert cosine_rows(got, reference_embed(texts)).min() >= 0.99999
        bad = c.post("/v1/embeddings", json={"input": [[5, 10 ** 9]], "model": "all-MiniLM-L6-v2"})
        assert 400 <= bad.status_code < 500, bad.text
        again = c.post("/v1/embeddings", json={"input": texts[:2], "model": "all-MiniLM-L6-v2"})
        assert again.status_code == 200
        np.testing.assert_allclose(np.array([d["embedding"] for d in again.json()["data"]]), got[:2], atol=1e-5)
