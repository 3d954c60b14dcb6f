"""A decoder embedding model (Qwen3-Embedding's layout: a causal-LM checkpoint with sentence-transformers'
last-token pooling files) behind a real `surge serve DIR`, called with the openai client and
huggingface_hub's InferenceClient (text-embeddings-inference's routes): sentence-transformers' vectors
come back; the model is listed as an embedding model and is not offered for chat."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.decoder_models import QWEN3_EMBEDDING_PROMPTS, build_embedding_model

    return build_embedding_model("qwen3", tmp_path_factory.mktemp("demb") / "qwen3-embedding", seed=4,
                                 num_hidden_layers=3, prompts=QWEN3_EMBEDDING_PROMPTS)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1", "--tei-embed", "--auto-truncate") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(model_dir):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model = SentenceTransformer(str(model_dir), device="cpu")
    return lambda texts, **kw: model.encode(texts, convert_to_numpy=True, **kw)


def test_openai_client_embeddings(server, reference, sentences):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = sentences[:12] + ["What's the weather like in Zürich?"]
    got = client.embeddings.create(model="qwen3-embedding", input=texts)
    vecs = np.array([d.embedding for d in got.data], dtype=np.float32)
    ref = reference(texts)
    assert vecs.shape == ref.shape == (13, 64)
    np.testing.assert_allclose(vecs, ref, atol=3e-5)
    assert got.usage.prompt_tokens > 13
    short = client.embeddings.create(model="qwen3-embedding", input=texts[:2], dimensions=16)
    assert len(short.data[0].embedding) == 16
    ids = [m.id for m in client.models.list().data]
    assert "qwen3-embedding" in ids


def test_tei_routes_and_inference_client(server, reference, sentences):
    from huggingface_hub import InferenceClient

    texts = sentences[20:24]
    r = httpx.post(server.url + "/embed", json={"inputs": texts}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json(), dtype=np.float32), reference(texts), atol=3e-5)
    vec = InferenceClient(model=server.url).feature_extraction(texts[0])
    np.testing.assert_allclose(np.asarray(vec, dtype=np.float32).reshape(-1), reference(texts[:1])[0], atol=3e-5)


def test_prompt_name(server, reference, sentences):
    """TEI's prompt_name: the model's sentence-transformers prompt before each text, as encode(prompt_name=...)
    puts it; an empty prompt changes nothing; an unknown name is TEI's 422 naming the model's prompts."""
    from huggingface_hub import InferenceClient

    texts = ["how do I reset my router", sentences[3]]
    query = reference(texts, prompt_name="query")
    assert np.abs(query - reference(texts)).max() > 0.05  # the instruction changes the vectors
    r = httpx.post(server.url + "/embed", json={"inputs": texts, "prompt_name": "query"}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json(), dtype=np.float32), query, atol=3e-5)
    r = httpx.post(server.url + "/embed", json={"inputs": texts, "prompt_name": "document"}, timeout=60)
    np.testing.assert_allclose(np.array(r.json(), dtype=np.float32), reference(texts), atol=3e-5)
    vec = InferenceClient(model=server.url).feature_extraction(texts[0], prompt_name="query", truncate=True)
    np.testing.assert_allclose(np.asarray(vec, dtype=np.float32).reshape(-1), query[0], atol=3e-5)
    r = httpx.post(server.url + "/embed", json={"inputs": texts, "prompt_name": "passage"}, timeout=60)
    # TEI's answer to a bad prompt_name: a 422 Validation error in its shape
    assert r.status_code == 422 and "'passage'" in r.text and "query, document" in r.text, r.text
    assert r.json()["error_type"] == "Validation"
    r = httpx.post(server.url + "/embed", json={"inputs": [[5, 6, 7]], "prompt_name": "query"}, timeout=60)
    assert r.status_code == 422 and "token ids" in r.text
    # TEI's /tokenize with the prompt: the tokens /embed computes for it
    plain, prompted = (httpx.post(server.url + "/tokenize", json={"inputs": texts[0], **kw}, timeout=60).json()[0]
                       for kw in ({}, {"prompt_name": "query"}))
    from tests.decoder_models import QWEN3_EMBEDDING_PROMPTS

    full = QWEN3_EMBEDDING_PROMPTS["query"] + texts[0]
    joined = "".join(t["text"] for t in prompted if not t["special"])  # cut at the model's 48 tokens, as /embed cuts
    assert len(prompted) > len(plain) and joined.startswith("Instruct:") and full.startswith(joined)
    assert "".join(t["text"] for t in plain if not t["special"]) == texts[0]


def test_not_a_chat_model(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "qwen3-embedding", "messages": [{"role": "user", "content": "hi"}]})
    assert 400 <= r.status_code < 500, r.text
    assert "qwen3-embedding" in r.text


def test_under_workers(model_dir, reference, sentences):
    """`--workers 2`: the front ends tokenize and prompt, the engine process runs the decoder embedder."""
    texts = sentences[30:34]
    with ServerProcess(str(model_dir), "--threads", "1", "--workers", "2", "--auto-truncate") as srv:
        for _ in range(2):  # the probe reaches either front end
            r = httpx.post(srv.url + "/embed", json={"inputs": texts, "prompt_name": "query"}, timeout=60)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(np.array(r.json()["embeddings"], dtype=np.float32),
                                       reference(texts, prompt_name="query"), atol=3e-5)


def test_decoder_classifier_and_reranker(tmp_path_factory, sentences):
    """`*ForSequenceClassification` decoders behind a real repository server: huggingface_hub's
    text_classification = transformers' pipeline, TEI's /rerank = sentence-transformers' CrossEncoder."""
    import transformers
    from huggingface_hub import InferenceClient
    from sentence_transformers import CrossEncoder

    from tests.decoder_models import build_decoder_classifier
    from tests.e2e.repo_helpers import add_version

    root = tmp_path_factory.mktemp("dcls")
    cls = build_decoder_classifier("qwen3", root / "src" / "cls", ["negative", "neutral", "positive"], seed=6)
    rr = build_decoder_classifier("qwen2", root / "src" / "rr", ["score"], seed=7)
    repo = root / "repo"
    for name, d in (("cls", cls), ("rr", rr)):
        add_version(repo, name, 1, f"source: {d}\nengine: {{threads: 1, warmup_shapes: [[1, 8]]}}\n")
    texts = sentences[40:44]
    transformers.logging.set_verbosity_error()
    pipe = transformers.pipeline("text-classification", model=str(cls), device="cpu", top_k=None)
    query, docs = "what does the import statement do", sentences[:6]
    want = np.asarray(CrossEncoder(str(rr), device="cpu").predict([(query, d) for d in docs]))
    with ServerProcess("--model-repository", str(repo), "--threads", "1") as srv:
        client = InferenceClient(model=srv.url + "/models/cls")
        for text, ref in zip(texts, pipe(texts)):
            got = {x.label: x.score for x in client.text_classification(text, top_k=3)}
            assert got == pytest.approx({x["label"]: x["score"] for x in ref}, abs=1e-4)
        r = httpx.post(srv.url + "/rerank", json={"model": "rr", "query": query, "texts": docs}, timeout=60)
        assert r.status_code == 200, r.text
        order = list(np.argsort(-want))
        assert [x["index"] for x in r.json()] == order
        assert [x["score"] for x in r.json()] == pytest.approx(want[order].tolist(), abs=1e-4)
