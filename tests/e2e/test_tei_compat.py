"""text-embeddings-inference (TEI) compatibility, against a real `surge serve --tei-embed` process:
TEI's error body and status per error type, /similarity, /embed_sparse on a model without a SPLADE
head, TEI's truncation default, and rerank's top_n 0.

What TEI answers is read from its router (huggingface/text-embeddings-inference v1.9.3,
router/src/http/server.rs and types.rs, core/src/infer.rs): `{"error": str, "error_type":
"Empty" | "Validation" | "Tokenizer" | "Backend" | "Overloaded" | "Unhealthy"}`, with the status
its `From<&ErrorType> for StatusCode` gives (Empty 400, Validation and Tokenizer 422 since v1.9.0,
Backend 424, Overloaded 429, Unhealthy 503). References: sentence-transformers FP32 on the bundled
all-MiniLM-L6-v2 and the cross-encoder of tests/task_models.py.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from surge.models import bundled_model_dir
from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess
from tests.task_models import task_models_dir

ENGINE = "engine: {threads: 1, warmup_shapes: [[1, 8]]}\n"
MAX_INPUTS = 8  # a small --max-inputs, so that "too many inputs" is a small body


@pytest.fixture(scope="module")
def models():
    return task_models_dir()


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory):
    """The bundled MiniLM without its sentence-transformers Normalize module: a model whose own
    default is unnormalized vectors (the weights are linked, not copied)."""
    import json

    src, d = bundled_model_dir(), tmp_path_factory.mktemp("minilm-raw")
    for f in src.iterdir():
        if f.name != "modules.json":
            (d / f.name).symlink_to(f)
    modules = [m for m in json.loads((src / "modules.json").read_text()) if not m["type"].endswith("Normalize")]
    (d / "modules.json").write_text(json.dumps(modules))
    return d


@pytest.fixture(scope="module")
def server(models, raw_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("teirepo")
    add_version(root, "minilm", 1, ENGINE + f"source: {bundled_model_dir()}\n")
    add_version(root, "raw", 1, ENGINE + f"source: {raw_dir}\n")
    add_version(root, "ce", 1, ENGINE + f"source: {models / 'ce'}\n")
    with ServerProcess("--model-repository", str(root), "--threads", "1", "--tei-embed",
                       "--max-inputs", str(MAX_INPUTS)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bundled_model_dir()), device="cpu")


LONG = "the quick brown fox jumps over the lazy dog " * 80  # ~720 tokens: past the model's 256 (and 512)

# (method, path, body, status, error_type): what TEI answers each with
TEI_ERRORS = [
    ("/embed", {"model": "minilm", "inputs": []}, 400, "Empty"),
    ("/embed", {"model": "minilm", "inputs": ["a"] * (MAX_INPUTS + 1)}, 422, "Validation"),
    ("/embed", {"model": "minilm", "inputs": LONG, "truncate": False}, 422, "Validation"),
    ("/embed", {"model": "minilm", "inputs": "hi", "dimensions": 385}, 422, "Validation"),
    ("/", {"model": "minilm", "inputs": []}, 400, "Empty"),
    ("/", {"model": "minilm", "inputs": LONG, "truncate": False}, 422, "Validation"),
    ("/rerank", {"model": "ce", "query": "q", "texts": []}, 400, "Empty"),
    ("/rerank", {"model": "ce", "query": "q", "texts": ["a"] * (MAX_INPUTS + 1)}, 422, "Validation"),
    ("/rerank", {"model": "minilm", "query": "q", "texts": ["a"]}, 424, "Backend"),  # not a re-ranker model
    ("/predict", {"model": "minilm", "inputs": "hello"}, 424, "Backend"),  # not a classifier
    ("/predict", {"model": "ce", "inputs": [["only one side"]]}, 422, "Validation"),
    ("/predict", {"model": "ce", "inputs": []}, 400, "Empty"),
    ("/tokenize", {"model": "minilm", "inputs": []}, 400, "Empty"),
    ("/decode", {"model": "minilm", "ids": []}, 400, "Empty"),
]


@pytest.mark.parametrize("path,body,status,error_type", TEI_ERRORS)
def test_tei_routes_answer_tei_error_bodies(client, path, body, status, error_type):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    got = r.json()
    assert set(got) == {"error", "error_type"}, got
    assert isinstance(got["error"], str) and got["error"], got
    assert got["error_type"] == error_type, got


def test_other_protocols_keep_their_error_bodies(client):
    """OpenAI's route (and surge's lifecycle GET /models/{name}) are not TEI's: their shapes stay."""
    r = client.post("/v1/embeddings", json={"model": "minilm", "input": []})
    assert r.status_code == 400 and isinstance(r.json()["error"], dict), r.text
    r = client.get("/models/nope")
    assert r.status_code == 404 and isinstance(r.json()["error"], dict), r.text


def test_inference_client_reads_the_error_message(server):
    """huggingface_hub reads TEI's `error` string into the exception (a nested object came out as
    its Python repr)."""
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    c = InferenceClient(model=server.url + "/models/minilm")
    with pytest.raises(HfHubHTTPError) as e:
        c.feature_extraction(LONG, truncate=False)
    assert e.value.response.status_code == 422
    msg = e.value.server_message
    assert msg and "{" not in msg and "token" in msg, msg


def test_similarity_route_matches_sentence_transformers(client, st_model, sentences):
    src, others = sentences[0], sentences[1:6]
    r = client.post("/similarity", json={"model": "minilm",
                                         "inputs": {"source_sentence": src, "sentences": others}})
    assert r.status_code == 200, r.text
    ref = st_model.encode([src] + others, convert_to_numpy=True).astype(np.float64)
    want = (ref[1:] @ ref[0]) / np.linalg.norm(ref[1:], axis=1) / np.linalg.norm(ref[0])
    assert r.json() == pytest.approx(want.tolist(), abs=1e-4)
    # TEI's parameters: truncate (a too-long sentence is refused without it)
    body = {"model": "minilm", "inputs": {"source_sentence": src, "sentences": [LONG]},
            "parameters": {"truncate": False}}
    r = client.post("/similarity", json=body)
    assert r.status_code == 422 and r.json()["error_type"] == "Validation", r.text
    body["parameters"]["truncate"] = True
    assert client.post("/similarity", json=body).status_code == 200
    r = client.post("/similarity", json={"model": "minilm", "inputs": {"source_sentence": src, "sentences": []}})
    assert r.status_code == 400 and r.json() == {"error": "`inputs.sentences` cannot be empty",
                                                 "error_type": "Empty"}


def test_embed_sparse_without_a_splade_head_is_teis_backend_error(client):
    r = client.post("/embed_sparse", json={"model": "minilm", "inputs": "hello"})
    assert r.status_code == 424, r.text
    assert r.json() == {"error": "Model is not an embedding model with SPLADE pooling", "error_type": "Backend"}


def test_tei_truncation_default_is_teis(client, st_model):
    """TEI (since v1.9.0) truncates by default (--auto-truncate defaults to true): a text longer than
    the model is embedded from its first max_length tokens, as sentence-transformers does."""
    want = st_model.encode([LONG], convert_to_numpy=True)[0]
    for path in ("/embed", "/"):
        r = client.post(path, json={"model": "minilm", "inputs": LONG})
        assert r.status_code == 200, (path, r.text)
        got = np.asarray(r.json()[0], dtype=np.float64)
        assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= 0.9999
    r = client.post("/rerank", json={"model": "ce", "query": "fox", "texts": [LONG, "a dog"]})
    assert r.status_code == 200, r.text
    r = client.post("/predict", json={"model": "ce", "inputs": ["fox", LONG]})
    assert r.status_code == 200, r.text


def test_rerank_top_n_zero_is_every_document(client, models):
    """top_n 0: every document, best first (vLLM's reading: its default top_n is 0)."""
    from sentence_transformers import CrossEncoder

    docs = ["The fox is quick.", "Dogs sleep a lot.", "Foxes are wild canids.", "Cats purr."]
    ref = np.asarray(CrossEncoder(str(models / "ce"), device="cpu").predict([("fox", d) for d in docs]))
    order = [int(i) for i in np.argsort(-ref)]
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        r = client.post(path, json={"model": "ce", "query": "fox", "documents": docs, "top_n": 0})
        assert r.status_code == 200, (path, r.text)
        res = r.json()["results"]
        assert [x["index"] for x in res] == order
        assert [x["relevance_score"] for x in res] == pytest.approx(ref[order].tolist(), abs=1e-5)
    r = client.post("/v1/rerank", json={"model": "ce", "query": "fox", "documents": docs, "top_n": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_n"


def test_embed_all_is_the_last_hidden_state_of_every_token(client, sentences):
    """POST /embed_all: TEI's [input][token][hidden], special tokens included, neither pooled nor
    normalized; truncated to the model's length by default, refused past it with truncate false."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = sentences[:3] + [LONG]
    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir()))
    model = AutoModel.from_pretrained(str(bundled_model_dir()), dtype=torch.float32).eval()
    r = client.post("/embed_all", json={"model": "minilm", "inputs": texts})
    assert r.status_code == 200, r.text
    got = r.json()
    assert len(got) == len(texts)
    for text, rows in zip(texts, got):
        enc = tok([text], truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            want = model(**enc).last_hidden_state[0].numpy().astype(np.float64)
        rows = np.asarray(rows, dtype=np.float64)
        assert rows.shape == want.shape  # [tokens incl. [CLS] and [SEP], 384]
        cos = (rows * want).sum(1) / np.linalg.norm(rows, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.9999, cos.min()
        np.testing.assert_allclose(rows, want, atol=2e-3, rtol=0)
    single = client.post("/embed_all", json={"model": "minilm", "inputs": texts[0]})
    assert single.status_code == 200 and np.asarray(single.json()).shape == (1,) + np.asarray(got[0]).shape
    r = client.post("/embed_all", json={"model": "minilm", "inputs": LONG, "truncate": False})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation", r.text
    r = client.post("/embed_all", json={"model": "minilm", "inputs": []})
    assert r.status_code == 400 and r.json()["error_type"] == "Empty", r.text
    r = client.post("/embed_all", json={"model": "ce", "inputs": "hi"})
    assert r.status_code == 424 and r.json()["error_type"] == "Backend", r.text


def test_tei_embed_normalizes_by_default_whatever_the_model(client, raw_dir, sentences):
    """TEI's `normalize` defaults to true on /embed whatever the model's own modules say; false gives
    the model's pooled vectors as sentence-transformers computes them."""
    from sentence_transformers import SentenceTransformer

    texts = sentences[:4]
    ref = SentenceTransformer(str(raw_dir), device="cpu").encode(texts, convert_to_numpy=True).astype(np.float64)
    assert np.linalg.norm(ref, axis=1).min() > 1.5  # really unnormalized
    unit = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    for path in ("/embed", "/"):
        r = client.post(path, json={"model": "raw", "inputs": texts})
        assert r.status_code == 200, (path, r.text)
        np.testing.assert_allclose(np.asarray(r.json(), dtype=np.float64), unit, atol=1e-4)
    r = client.post("/embed", json={"model": "raw", "inputs": texts, "normalize": False})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.asarray(r.json(), dtype=np.float64), ref, rtol=1e-3, atol=1e-3)


# What each text-only route's `inputs` takes, as its error says it: token ids are surge's native /embed's
# and OpenAI's, never these routes'.
TEXT_ONLY = [
    ("/", "minilm", ["a string", "a list of strings", '{"text", "text_pair"}', '{"source_sentence", "sentences"}']),
    ("/models/minilm", None, ["a string", "a list of strings"]),
    ("/predict", "ce", ["a string", "a pair of strings"]),
    ("/tokenize", "minilm", ["a string", "a list of strings"]),
    ("/embed_all", "minilm", ["a string", "a list of strings"]),
    ("/embed_sparse", "minilm", ["a string", "a list of strings"]),
]


@pytest.mark.parametrize("path,model,accepted", TEXT_ONLY)
@pytest.mark.parametrize("inputs", [[[101, 7592, 102]], [101, 7592, 102], 7592])
def test_text_only_routes_do_not_suggest_token_ids(client, path, model, accepted, inputs):
    """A body of token ids on a route that takes only text is told what the route takes, not the
    embeddings routes' "a list of token ids, or a list of token-id lists"."""
    body = {"inputs": inputs, **({"model": model} if model else {})}
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    got = r.json()
    assert got["error_type"] == "Validation", got
    msg = got["error"]
    assert "inputs" in msg and "token id" in msg and "not token ids" in msg, msg
    assert "list of token ids" not in msg and "token-id lists" not in msg, msg
    for shape in accepted:
        assert shape in msg, (shape, msg)
