"""Task models behind a real `surge serve --model-repository`, called with real clients:
huggingface_hub.InferenceClient (feature_extraction, text_classification, token_classification,
sentence_similarity), the TEI routes, POST /v1/rerank (Cohere shape), KServe v2 over HTTP and gRPC
(tritonclient), one backbone with three heads (intent + slots + embedding), bad input and wrong tasks;
and a decoder checkpoint refused at startup."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from surge.models import bundled_model_dir
from surge.models.finetune import heldout_commands
from tests.conftest import cosine_rows
from tests.e2e.repo_helpers import add_version
from tests.server_process import ROOT, ServerProcess, free_port
from tests.task_models import task_models_dir

ENGINE = "engine: {threads: 1, warmup_shapes: [[1, 8]]}\n"
PASSAGES = ["Lights can be switched on by voice in every room.", "Timers ring when the countdown ends.",
            "The thermostat keeps the temperature you set.", "Music plays on any speaker in the house.",
            "Reminders are sent as notifications.", "Weather forecasts cover the next ten days."]
PIPELINE = """
inputs: {query: text}
nodes:
  - {name: intent, model: intent, inputs: {text: input.query}}
  - {name: slots, model: slots, inputs: {text: input.query}, params: {aggregation_strategy: simple}}
  - {name: emb, model: embed, inputs: {text: input.query}}
  - {name: top, step: topk, inputs: {vector: emb.vector}, params: {passages: passages.yaml, k: 4}}
  - {name: rr, model: ce, inputs: {text: input.query, ranking: top.ranking}}
outputs: {intent: intent.label, entities: slots.entities, answers: rr.ranking, best: rr.best}
"""


@pytest.fixture(scope="module")
def models():
    return task_models_dir()


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("taskrepo")
    add_version(root, "assistant", 1, ENGINE + f"""heads:
  - {{name: intent, task: classify, source: {models / 'intent'}}}
  - {{name: slots, task: token-classify, source: {models / 'slots'}}}
  - {{name: embed, task: embed}}
""")
    add_version(root, "ce", 1, ENGINE + f"source: {models / 'ce'}\n")
    (root / "assist").mkdir()
    (root / "assist" / "passages.yaml").write_text(json.dumps({"passages": PASSAGES}))
    (root / "assist" / "pipeline.yaml").write_text(PIPELINE)
    with ServerProcess("--model-repository", str(root), "--threads", "1", "--tei-embed", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _pipe(models, name, task, **kw):
    import transformers
    from transformers import pipeline

    transformers.logging.set_verbosity_error()
    return pipeline(task, model=str(models / name), device="cpu", **kw)


def test_inference_client_text_and_token_classification(server, models):
    from huggingface_hub import InferenceClient

    texts = heldout_commands(4) + ["Turn on the lights in Zürich's kitchen, please!"]
    intent = InferenceClient(model=server.url)  # POST /: the default model is the first head (intent)
    ref = _pipe(models, "intent", "text-classification", top_k=None)
    for t in texts:
        got = intent.text_classification(t, top_k=3)
        want = ref(t)
        want = (want[0] if isinstance(want[0], list) else want)[:3]
        assert [g.label for g in got] == [w["label"] for w in want]
        assert [g.score for g in got] == pytest.approx([w["score"] for w in want], abs=1e-4)
    slots = InferenceClient(model=server.url + "/models/slots")
    for strategy in ("simple", "max"):
        pipe = _pipe(models, "slots", "token-classification", aggregation_strategy=strategy)
        for t in texts:
            got = slots.token_classification(t, aggregation_strategy=strategy)
            want = pipe(t)
            assert [(g.entity_group, g.word, g.start, g.end) for g in got] == \
                [(w["entity_group"], w["word"], w["start"], w["end"]) for w in want]
            assert [g.score for g in got] == pytest.approx([float(w["score"]) for w in want], abs=1e-4)


def test_inference_client_feature_extraction_and_similarity(server, reference_embed, sentences):
    from huggingface_hub import InferenceClient

    emb = InferenceClient(model=server.url + "/models/embed")
    texts = sentences[:5]
    got = np.vstack([np.asarray(emb.feature_extraction(t)) for t in texts])
    assert got.shape == (5, 384)
    assert cosine_rows(got, reference_embed(texts)).min() >= 0.99999
    sims = emb.sentence_similarity(texts[0], other_sentences=texts[1:])
    ref = reference_embed(texts)
    want = (ref[1:] @ ref[0]) / np.linalg.norm(ref[1:], axis=1) / np.linalg.norm(ref[0])
    assert sims == pytest.approx(want.tolist(), abs=1e-4)


def test_rerank_routes_match_cross_encoder(client, models, sentences):
    from sentence_transformers import CrossEncoder

    query = "what happens when a module is imported"
    docs = sentences[:12]
    ref = np.asarray(CrossEncoder(str(models / "ce"), device="cpu").predict([(query, d) for d in docs]))
    order = list(np.argsort(-ref))
    r = client.post("/rerank", json={"model": "ce", "query": query, "texts": docs, "return_text": True,
                                     "truncate": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [x["index"] for x in got] == order
    assert [x["score"] for x in got] == pytest.approx(ref[order].tolist(), abs=1e-5)
    assert got[0]["text"] == docs[order[0]]
    r = client.post("/v1/rerank", json={"model": "ce", "query": query, "documents": [{"text": d} for d in docs],
                                        "top_n": 3, "return_documents": True})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [x["index"] for x in res] == order[:3]
    assert [x["relevance_score"] for x in res] == pytest.approx(ref[order[:3]].tolist(), abs=1e-5)
    assert res[0]["document"]["text"] == docs[order[0]]
    # top_n past the number of documents: all of them, best first (Cohere's answer; LangChain's
    # CohereRerank sends its default top_n=3 whatever it was given)
    r = client.post("/v1/rerank", json={"model": "ce", "query": query, "documents": docs[:2], "top_n": 3})
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == sorted(range(2), key=lambda i: -ref[i])
    # the same body on Cohere's v2 path and on /rerank (vLLM's routes): the same ranking
    body = {"model": "ce", "query": query, "documents": docs, "top_n": 5, "return_documents": True}
    for path in ("/v2/rerank", "/rerank"):
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        assert [(x["index"], x["document"]["text"]) for x in r.json()["results"]] == [(i, docs[i]) for i in order[:5]]
    # TEI /predict with pairs and the HF sentence-similarity shape on a reranker
    r = client.post("/predict", json={"model": "ce", "inputs": [[query, docs[0]], [query, docs[1]]], "raw_scores": True})
    assert r.status_code == 200
    assert r.json()[0][0]["score"] == pytest.approx(float(np.log(ref[0] / (1 - ref[0]))), abs=1e-4)


def test_kserve_task_contracts_http_and_grpc(server, models):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import torch

    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    texts = heldout_commands(4)
    h = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    g = grpcclient.InferenceServerClient(server.grpc_url)
    meta = h.get_model_metadata("intent")
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 9]}]
    gmeta = g.get_model_metadata("ce")
    assert [i.name for i in gmeta.inputs] == ["text", "text_pair"] and list(gmeta.outputs[0].shape) == [-1, 1]
    assert [o["name"] for o in h.get_model_metadata("slots")["outputs"]] == ["logits", "lengths"]
    tok = AutoTokenizer.from_pretrained(str(models / "intent"))
    with torch.no_grad():
        want = AutoModelForSequenceClassification.from_pretrained(str(models / "intent")).eval()(
            **tok(texts, padding=True, return_tensors="pt")).logits.numpy()
        tags = AutoModelForTokenClassification.from_pretrained(str(models / "slots")).eval()
        want_tok = [tags(**tok([t], return_tensors="pt")).logits[0].numpy() for t in texts]
        ce = AutoModelForSequenceClassification.from_pretrained(str(models / "ce")).eval()
        want_ce = ce(**tok(["turn on the lights"] * len(texts), texts, padding=True,
                           return_tensors="pt")).logits[:, 0].numpy()
    for mod in (httpclient, grpcclient):
        c = h if mod is httpclient else g
        x = mod.InferInput("text", [len(texts)], "BYTES")
        x.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
        np.testing.assert_allclose(c.infer("intent", [x]).as_numpy("logits"), want, atol=1e-3)
        q = mod.InferInput("text", [1], "BYTES")  # one query against every document
        q.set_data_from_numpy(np.array([b"turn on the lights"], dtype=object))
        docs = mod.InferInput("text_pair", [len(texts)], "BYTES")
        docs.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
        scores = c.infer("ce", [q, docs]).as_numpy("logits")
        assert scores.shape == (len(texts), 1)
        np.testing.assert_allclose(scores[:, 0], want_ce, atol=1e-3)
        res = c.infer("slots", [x])
        logits, lengths = res.as_numpy("logits"), res.as_numpy("lengths")
        for i, w in enumerate(want_tok):
            assert lengths[i] == len(w)
            np.testing.assert_allclose(logits[i, :lengths[i]], w, atol=1e-3)
    h.close()  # tritonclient's __del__ closes a forgotten client on whatever thread collects it, and warns
    g.close()


# OpenAI-shaped errors (Cohere's and OpenAI's routes): the field named in `param`
BAD = [
    ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["a"], "top_n": -1}, 400, "top_n"),
    ("/v1/rerank", {"model": "ce", "query": "q", "documents": []}, 400, "documents"),
    ("/v1/embeddings", {"model": "intent", "input": "hello"}, 400, "model"),
    ("/v1/rerank", {"model": "slots", "query": "q", "documents": ["a"]}, 400, "model"),
]
# TEI's routes answer TEI's {"error", "error_type"} with its statuses (tests/e2e/test_tei_compat.py)
BAD_TEI = [
    ("/predict", {"model": "intent", "inputs": []}, 400, "Empty", "inputs"),
    ("/predict", {"model": "ce", "inputs": [["only one side"]]}, 422, "Validation", "inputs"),
    ("/predict", {"model": "ce", "inputs": [["a", ""], ["b", "c"]]}, 400, "Empty", "inputs"),
    ("/rerank", {"model": "ce", "query": "q", "texts": []}, 400, "Empty", "texts"),
    ("/rerank", {"model": "ce", "query": "q", "texts": ["x"] * 3000}, 422, "Validation", "texts"),
    ("/rerank", {"model": "ce", "query": "q", "texts": ["word " * 600], "truncate": False}, 422, "Validation",
     "texts"),
    ("/models/intent", {"inputs": "play jazz", "parameters": {"truncate": "false"}}, 422, "Validation", "truncate"),
    ("/models/slots", {"inputs": "play jazz", "parameters": {"aggregation_strategy": "longest"}}, 422, "Validation",
     "aggregation_strategy"),
    ("/rerank", {"model": "intent", "query": "q", "texts": ["a"]}, 424, "Backend", "serves task"),
    ("/predict", {"model": "embed", "inputs": "hello"}, 424, "Backend", "serves task"),
]


@pytest.mark.parametrize("path,body,status,field", BAD)
def test_bad_input_is_a_clear_4xx(client, path, body, status, field):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    if field == "model":
        assert "serves task" in err["message"]


@pytest.mark.parametrize("path,body,status,error_type,named", BAD_TEI)
def test_bad_input_on_tei_routes_is_teis_error(client, path, body, status, error_type, named):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["error_type"] == error_type and named in err["error"], err


def test_truncate_option_and_other_requests_unaffected(client, models):
    long = "turn on the lights " * 200
    assert client.post("/predict", json={"model": "intent", "inputs": long, "truncate": False}).status_code == 422
    for body in ({"model": "intent", "inputs": long, "truncate": True}, {"model": "intent", "inputs": long}):
        ok = client.post("/predict", json=body)  # TEI truncates by default (v1.9.0 on)
        assert ok.status_code == 200 and ok.json()[0]["label"]
    # a bad request among good ones: the good ones get their own answers
    ref = _pipe(models, "intent", "text-classification")
    texts = heldout_commands(5)
    with httpx.Client(base_url=str(client.base_url), timeout=60) as c:
        for t in texts:
            assert c.post("/predict", json={"model": "intent", "inputs": [t, t, ""]}).status_code == 400  # Empty
            r = c.post("/predict", json={"model": "intent", "inputs": t})
            want = ref(t)
            assert r.json()[0]["label"] == (want[0][0] if isinstance(want[0], list) else want[0])["label"]


def _model_metrics(url: str, model: str) -> dict[tuple, float]:
    """{(sample name, labels without model/version): value} of one model from GET /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.labels.get("model") == model:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "version")))
                out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def test_a_client_that_leaves_a_task_route_is_not_computed(server, sentences):
    """A client that disconnects has its queued inputs dropped (cancelled), on the task routes: the
    rerank routes, and a plain POST /predict answered by the task hot path (the server's timeout is
    30 s: only the disconnect can stop this work)."""
    texts = [f"{sentences[i % len(sentences)]} left{i} {time.time_ns()}" for i in range(3000)]
    before = {m: _model_metrics(server.url, m) for m in ("ce", "assistant")}

    async def impatient():
        async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as c:
            return await asyncio.gather(
                c.post("/v1/rerank", json={"model": "ce", "query": "a query", "documents": texts[:1000]}),
                c.post("/rerank", json={"model": "ce", "query": "a query", "texts": texts[1000:2000],
                                        "truncate": True}),
                c.post("/predict", json={"model": "intent", "inputs": texts[2000:]}),
                return_exceptions=True)

    outcomes = asyncio.run(impatient())
    assert all(isinstance(o, httpx.TimeoutException) for o in outcomes), outcomes
    for model, sent in (("ce", 2000), ("assistant", 1000)):
        deadline = time.monotonic() + 20
        while _model_metrics(server.url, model)[("surge_inflight_inputs", ())] > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        after = _model_metrics(server.url, model)
        assert after[("surge_inflight_inputs", ())] == 0, model
        key = ("surge_inputs_dropped_total", (("reason", "cancelled"),))
        dropped = after.get(key, 0) - before[model].get(key, 0)
        computed = after[("surge_batch_size_sum", ())] - before[model].get(("surge_batch_size_sum", ()), 0)
        # inputs queued when the client left are dropped, not computed (none may have been queued yet)
        assert computed + dropped <= sent and computed < sent, (model, computed, dropped)


def test_plain_predict_hot_path_answers_as_the_route(client, models):
    """Plain POST /predict bodies (texts only) are answered by server/http/task_hotpath.py; a body with
    an option goes through the FastAPI route: the same JSON, and both what transformers' pipeline says."""
    ref = _pipe(models, "intent", "text-classification", top_k=None)
    texts = heldout_commands(6, seed=23) + ["Please switch the kitchen lights off in Zürich"]
    for body in ({"model": "intent", "inputs": texts[0]}, {"model": "intent", "inputs": texts[:1]},
                 {"model": "intent", "inputs": texts[:3]}, {"model": "intent", "inputs": texts}):
        hot = client.post("/predict", json=body)
        route = client.post("/predict", json={**body, "raw_scores": False})
        assert hot.status_code == route.status_code == 200, (hot.text, route.text)
        assert hot.json() == route.json()
        got = hot.json()
        got = [got] if isinstance(body["inputs"], str) else got
        want = [ref(t) for t in ([body["inputs"]] if isinstance(body["inputs"], str) else body["inputs"])]
        for g, w in zip(got, want):
            w = w[0] if isinstance(w[0], list) else w
            assert [x["label"] for x in g] == [x["label"] for x in w]
            assert [x["score"] for x in g] == pytest.approx([x["score"] for x in w], abs=1e-4)
    # what the hot path leaves to the route: a two-text list is a pair (TEI), a bad text a 400 naming the field
    pair = client.post("/predict", json={"model": "intent", "inputs": texts[:2]})
    assert pair.status_code == 200 and isinstance(pair.json()[0], dict)
    bad = client.post("/predict", json={"model": "intent", "inputs": [texts[0], "  ", texts[1]]})
    assert bad.status_code == 400 and bad.json()["error_type"] == "Empty" and "inputs[1]" in bad.json()["error"]
    wrong = client.post("/predict", json={"model": "slots", "inputs": texts[0]})
    assert wrong.status_code == 424 and "serves task" in wrong.json()["error"]


def test_info_tokenize_decode(client, models):
    ce = client.get("/info", params={"model": "ce"}).json()
    # TEI's dtype names (a decoder's /info too) and the checkpoint's architecture
    assert ce["model_dtype"] == "float32"
    assert ce["architecture"] == json.loads((models / "ce" / "config.json").read_text())["architectures"][0]
    info = client.get("/info", params={"model": "intent"}).json()
    assert info["model_type"]["classifier"]["id2label"]["0"] == "lights_on" and info["task"] == "classify"
    assert client.get("/info", params={"model": "embed"}).json()["model_type"] == {"embedding": {"pooling": "mean"}}
    toks = client.post("/tokenize", json={"model": "intent", "inputs": "Play Jazz"}).json()[0]
    assert [t["text"] for t in toks] == ["[CLS]", "Play", "Jazz", "[SEP]"] and toks[1]["start"] == 0
    ids = [t["id"] for t in toks]
    assert client.post("/decode", json={"model": "intent", "ids": ids}).json() == ["play jazz"]


def test_unsupported_architecture_is_a_clear_startup_error(tmp_path):
    """Never a silent embedding server: the architecture is named, the supported ones listed."""
    d = tmp_path / "qa"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["BertForQuestionAnswering"], "model_type": "bert",
                                               "hidden_size": 32, "vocab_size": 30522}))
    shutil.copy(bundled_model_dir() / "tokenizer.json", d / "tokenizer.json")
    p = subprocess.run([sys.executable, "-m", "surge.cli.main", "serve", str(d), "--port", str(free_port()),
                        "--grpc-port", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    # Exit status 1 (what cli/serve.py means), not death by the SIGTERM that stopped uvicorn (143: the shell
    # prints "Terminated"); a configuration error is its message, not a traceback.
    assert p.returncode == 1, (p.returncode, (p.stdout + p.stderr)[-2000:])
    out = p.stdout + p.stderr
    assert "BertForQuestionAnswering" in out and "supported" in out and "ForSequenceClassification" in out
    assert "Traceback" not in out, out[-2000:]


def test_pipeline_calls_every_task(client, models):
    """classify with the trained head, tag slots, retrieve with the embedding head, rerank the top-k."""
    from sentence_transformers import CrossEncoder

    q = "turn on the lights in the kitchen"
    r = client.post("/pipelines/assist", json={"inputs": {"query": q}})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]
    assert out["intent"] == "lights_on"
    assert {e["entity_group"] for e in out["entities"]} >= {"device", "room"}
    answers = out["answers"]
    assert len(answers) == 4 and out["best"] == answers[0]["text"]
    ref = CrossEncoder(str(models / "ce"), device="cpu").predict([(q, a["text"]) for a in answers])
    assert [a["rerank_score"] for a in answers] == pytest.approx([float(x) for x in ref], abs=1e-5)
    assert list(ref) == sorted(ref, reverse=True)


def test_tei_embed_shape(client, reference_embed, sentences):
    """--tei-embed: POST /embed answers TEI's bare array (the native object otherwise)."""
    r = client.post("/embed", json={"inputs": sentences[:3], "model": "embed"})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json(), dtype=np.float32)
    assert got.shape == (3, 384)
    assert cosine_rows(got, reference_embed(sentences[:3])).min() >= 0.99999
    wrong = client.post("/embed", json={"inputs": "hi", "model": "intent"})  # TEI's errors too: not an embedder
    assert wrong.status_code == 424 and wrong.json()["error_type"] == "Backend"
