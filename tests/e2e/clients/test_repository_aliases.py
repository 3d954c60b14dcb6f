"""`aliases:` in model.yaml: a repository model answers to OpenAI's names on every
protocol; an alias that clashes with another model's name fails that load, clearly."""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import cosine_rows
from tests.e2e.repo_helpers import FAST, add_version
from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("alias-repo")
    add_version(root, "enc", 1, FAST + "aliases: [text-embedding-3-small, text-embedding-ada-002]\n")
    add_version(root, "clash", 1, FAST + "aliases: [enc]\n")
    with ServerProcess("--model-repository", str(root), "--threads", "1", grpc=True) as srv:
        yield srv


def test_repository_aliases_answer_everywhere(server, reference_embed, sentences):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oa.models.list()] == ["enc", "text-embedding-3-small", "text-embedding-ada-002"]
    texts = sentences[60:63]
    resp = oa.embeddings.create(model="text-embedding-ada-002", input=texts)
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert cosine_rows(got, reference_embed(texts)).min() >= 0.99999
    r = httpx.post(server.url + "/v2/models/text-embedding-3-small/infer", timeout=60, json={
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [texts[0]]}]})
    assert r.status_code == 200 and r.json()["model_name"] == "enc"
    with grpc.insecure_channel(server.grpc_url) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        assert check(health_pb2.HealthCheckRequest(service="text-embedding-3-small"), timeout=10).status == 1


def test_an_alias_clashing_with_a_model_name_fails_that_load(server):
    models = {m["name"]: m for m in httpx.get(server.url + "/models", timeout=30).json()["models"]}
    assert models["enc"]["state"] == "READY"
    clash = models["clash"]
    assert clash["state"] == "UNAVAILABLE" and "alias 'enc' is the name of another model" in clash["reason"]
    assert "clash/1/model.yaml" in clash["reason"]
