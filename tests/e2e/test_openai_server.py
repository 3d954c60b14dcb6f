"""A real `surge serve` process, called with a real HTTP client."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.conftest import cosine_rows
from tests.server_process import ServerProcess

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-inputs", "16", "--max-body-bytes", "65536", "--threads", "2") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_openai_response_shape_and_values(client, reference_embed, sentences):
    texts = sentences[:5]
    r = client.post("/v1/embeddings", json={"input": texts, "model": "all-MiniLM-L6-v2"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
    assert [d["index"] for d in body["data"]] == list(range(5))
    assert all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert cosine_rows(got, reference_embed(texts)).min() >= 0.99999
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 5
    assert r.headers["x-surge-model-version"] == "1"


def test_single_string_base64_and_token_ids(client, reference_embed):
    text = "How do I reset my password?"
    r = client.post("/v1/embeddings", json={"input": text, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype=np.float32)
    ref = reference_embed([text])
    assert cosine_rows(vec[None], ref)[0] >= 0.99999
    ids = reference_embed.tok(text)["input_ids"]
    # Token ids on the OpenAI route need --allow-token-ids (tests/e2e/test_openai_compat.py);
    # the native route takes them as the model's own ids.
    r2 = client.post("/v1/embeddings", json={"input": ids})
    assert r2.status_code == 400 and "check_embedding_ctx_length=False" in r2.json()["error"]["message"]
    r3 = client.post("/embed", json={"inputs": [ids, ids[:4]]})
    assert r3.status_code == 200 and len(r3.json()["embeddings"]) == 2
    assert cosine_rows(np.array(r3.json()["embeddings"][:1]), ref)[0] >= 0.99999


def test_native_embed_and_models(client):
    r = client.post("/embed", json={"inputs": ["turn on the lights", "play some jazz"], "normalize": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dimensions"] == 384 and body["version"] == "1"
    norms = np.linalg.norm(np.array(body["embeddings"]), axis=1)
    assert not np.allclose(norms, 1.0)  # normalize=false really skips it
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "all-MiniLM-L6-v2"
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_errors_take_openais_body_on_both_paths(client, path):
    """README: the HTTP API's routes answer errors in OpenAI's body. /v2/rerank is Cohere's v2 rerank
    (vLLM's too), not a KServe route: it errs as /v1/rerank does, where it took KServe's bare string."""
    r = client.post(path, json={"query": "q", "documents": ["a", "b"]})  # an embedding model: wrong task
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "serves task 'embed'" in err["message"], err
    r = client.post(path, json={"query": "q"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "documents", r.text
    # a body with no Content-Type is refused as on every non-KServe route (KServe's infer takes it)
    r = client.post(path, content=b'{"query": "q", "documents": ["a"]}')  # httpx sends no Content-Type
    assert r.status_code == 415 and "Content-Type" in r.json()["error"]["message"], r.text


BAD_REQUESTS = [
    ("invalid json", dict(content=b'{"input": [', headers={"content-type": "application/json"}), 400, "not valid JSON"),
    ("invalid utf-8", dict(content=b'{"input": "\xff\xfe"}', headers={"content-type": "application/json"}), 400, "UTF-8"),
    ("wrong type", dict(json={"input": 12}), 422, "input"),
    ("wrong list type", dict(json={"input": [1.5, 2]}), 422, "input"),
    ("missing input", dict(json={"model": "x"}), 422, "input"),
    ("empty list", dict(json={"input": []}), 400, "empty"),
    ("empty string", dict(json={"input": ""}), 400, "empty string"),
    ("blank string in list", dict(json={"input": ["ok", "  "]}), 400, "input 1"),
    ("too many inputs", dict(json={"input": ["hi"] * 17}), 413, "at most 16"),
    ("oversized body", dict(json={"input": "word " * 20000}), 413, "exceeds"),
    ("unknown model", dict(json={"input": "hi", "model": "gpt-9"}), 404, "gpt-9"),
    ("bad encoding format", dict(json={"input": "hi", "encoding_format": "hex"}), 422, "encoding_format"),
    ("token ids without --allow-token-ids", dict(json={"input": [101, 999999]}), 400, "expects text"),
    ("body not an object", dict(json=["hi"]), 400, "JSON object"),
    ("dimensions too large", dict(json={"input": "hi", "dimensions": 1000}), 400, "dimensions"),
]


@pytest.mark.parametrize("name,kwargs,status,needle", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_clear_error_and_server_keeps_serving(client, name, kwargs, status, needle):
    r = client.post("/v1/embeddings", **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower(), err
    assert set(err) == {"message", "type", "param", "code"}
    ok = client.post("/v1/embeddings", json={"input": "still serving"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


def test_api_key_required_except_health():
    with ServerProcess("--api-key", API_KEY, "--threads", "1") as srv, httpx.Client(base_url=srv.url) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        r = c.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/embeddings", json={"input": "hi"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/embeddings", json={"input": "hi"}, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
