"""Task results in the shared Redis cache tier: a second server process answers a classification
and a rerank from what the first one computed (a real redis-server, real HTTP), with the same
scores as transformers / sentence-transformers and without running its engine."""

from __future__ import annotations

import uuid

import httpx
import numpy as np
import pytest

from surge.models.finetune import heldout_commands
from tests.e2e.repo_helpers import FAST, add_version
from tests.e2e.test_runtime_serving import metrics
from tests.redis_server import redis_server  # noqa: F401  (fixture)
from tests.server_process import ServerProcess
from tests.task_models import task_models_dir

SHARED = ("surge_cache_hits_total", (("tier", "shared"),))
BATCHED = ("surge_batch_size_sum", ())


def _repo(root, models):
    add_version(root, "intent", 1, FAST + f"source: {models / 'intent'}\n")
    add_version(root, "ce", 1, FAST + f"source: {models / 'ce'}\n")
    return root


def test_second_server_answers_tasks_from_redis(redis_server, tmp_path, sentences):  # noqa: F811
    from sentence_transformers import CrossEncoder
    from transformers import pipeline

    models = task_models_dir()
    root = _repo(tmp_path / "repo", models)
    tag = uuid.uuid4().hex[:8]  # inputs no earlier run left in this redis-server
    texts = [f"{t} ({tag})" for t in heldout_commands(6)]
    query = f"how do I set a timer ({tag})"
    docs = sentences[:8]
    args = ("--model-repository", str(root), "--threads", "1", "--redis-url", redis_server)
    with ServerProcess(*args) as first:
        a = httpx.post(first.url + "/predict", json={"model": "intent", "inputs": texts}, timeout=60)
        ra = httpx.post(first.url + "/rerank", json={"model": "ce", "query": query, "texts": docs}, timeout=60)
        assert a.status_code == ra.status_code == 200, (a.text, ra.text)
        before = metrics(first.url)
        assert before.get(SHARED, 0) == 0
    with ServerProcess(*args) as second:
        before = metrics(second.url)
        b = httpx.post(second.url + "/predict", json={"model": "intent", "inputs": texts}, timeout=60)
        rb = httpx.post(second.url + "/rerank", json={"model": "ce", "query": query, "texts": docs}, timeout=60)
        after = metrics(second.url)
    assert b.status_code == rb.status_code == 200, (b.text, rb.text)
    assert b.json() == a.json() and rb.json() == ra.json()
    assert after[SHARED] - before.get(SHARED, 0) == len(texts) + len(docs)
    assert after.get(BATCHED, 0) == before.get(BATCHED, 0)  # the second server's engine never ran
    # and what Redis handed back is transformers' answer
    clf = pipeline("text-classification", model=str(models / "intent"), device="cpu")
    want = clf(texts)
    assert [r[0]["label"] for r in b.json()] == [w["label"] for w in want]
    assert [r[0]["score"] for r in b.json()] == pytest.approx([w["score"] for w in want], abs=1e-5)
    ref = np.asarray(CrossEncoder(str(models / "ce"), device="cpu").predict([(query, d) for d in docs]))
    got = rb.json()
    assert [x["index"] for x in got] == list(np.argsort(-ref))
    assert [x["score"] for x in got] == pytest.approx(np.sort(ref)[::-1].tolist(), abs=1e-5)
