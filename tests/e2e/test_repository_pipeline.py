"""The shipped assistant intent pipeline, served by a real `surge serve` from the
example repository: held-out accuracy, equality with the steps done by hand
(PyTorch reference + float64 math), clear errors for bad requests and for an
invalid pipeline.yaml."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
import yaml

import surge.examples.intent as example
from tests.server_process import ServerProcess

MIN_ACCURACY = 0.9  # on the 40 held-out utterances of examples/intent/.../heldout.yaml


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("example") / "repository"
    shutil.copytree(example.repository_dir(), root)
    (root / "broken").mkdir()
    (root / "broken" / "pipeline.yaml").write_text(
        "inputs: {q: text}\n"
        "nodes:\n"
        "  - {name: a, step: normalize, inputs: {vector: b.vector}}\n"
        "  - {name: b, step: normalize, inputs: {vector: a.vector}}\n"
        "outputs: {v: a.vector}\n")
    return root


@pytest.fixture(scope="module")
def client(repo):
    with ServerProcess("--model-repository", str(repo), "--threads", "2") as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


def run(client, queries: list[str]) -> list[dict]:
    r = client.post("/pipelines/assistant", json={"inputs": [{"query": q} for q in queries]})
    assert r.status_code == 200, r.text
    return [item["outputs"] for item in r.json()["results"]]


def test_heldout_accuracy(client):
    heldout = example.load_heldout()
    intents = example.load_intents()
    assert len(intents) == 10 and not {t for t, _ in heldout} & {t for v in intents.values() for t in v}
    outputs = run(client, [t for t, _ in heldout])
    correct = sum(o["intent"] == label for o, (_, label) in zip(outputs, heldout))
    wrong = [(t, label, o["intent"]) for o, (t, label) in zip(outputs, heldout) if o["intent"] != label]
    print(f"\nheld-out intent accuracy: {correct}/{len(heldout)} = {correct / len(heldout):.3f}; wrong: {wrong}")
    assert correct / len(heldout) >= MIN_ACCURACY, wrong


def test_pipeline_equals_steps_by_hand(client, reference_embed):
    intents = example.load_intents()
    passages = yaml.safe_load((example.pipeline_dir() / "faq.yaml").read_text())["passages"]
    queries = ["how do I factory reset you", "why won't you connect to the wifi", "will it rain tomorrow",
               "put apples on my shopping list", "tell me something funny", "how can I change your voice"]
    got = run(client, queries)

    # By hand: reference embeddings, prototypes = normalized means of the examples.
    labels = list(intents)
    examples = reference_embed([t for v in intents.values() for t in v]).astype(np.float64)
    owner = np.array([i for i, v in enumerate(intents.values()) for _ in v])
    protos = np.stack([examples[owner == i].mean(0) for i in range(len(labels))])
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    q = reference_embed(queries).astype(np.float64)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    sims = q @ protos.T
    faq = reference_embed([p["text"] for p in passages]).astype(np.float64)
    faq /= np.linalg.norm(faq, axis=1, keepdims=True)
    searched = 0
    for i, out in enumerate(got):
        best = int(np.argmax(sims[i]))
        assert out["intent"] == labels[best]
        assert abs(out["confidence"] - sims[i, best]) < 1e-4
        action = {"question": "search", "smalltalk": "chat"}.get(labels[best], "act")
        assert out["action"] == action
        assert out["tokens"] == len(reference_embed.tok(queries[i])["input_ids"])
        if action == "search":
            searched += 1
            scores = faq @ q[i]
            order = np.argsort(-scores)[:3]
            assert [a["id"] for a in out["answers"]] == [passages[j]["id"] for j in order]
            assert np.allclose([a["score"] for a in out["answers"]], scores[order], atol=1e-4)
        else:
            assert out["answers"] is None  # the FAQ branch did not run
    assert searched == 3
    assert got[0]["answers"][0]["id"] == "reset" and got[1]["answers"][0]["id"] == "wifi"


def test_single_request_reports_model_versions(client):
    r = client.post("/pipelines/assistant", json={"inputs": {"query": "how do I pair my phone over bluetooth"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["outputs"]["intent"] == "question" and body["outputs"]["answers"][0]["id"] == "bluetooth"
    assert body["models"] == {"minilm": "1", "minilm-faq": "1"}
    r = client.post("/pipelines/assistant", json={"inputs": {"query": "turn off the lights"}})
    assert r.json()["models"] == {"minilm": "1"}


BAD = [
    ("missing field", {"inputs": {"q": "hi"}}, 400, "query"),
    ("empty query", {"inputs": {"query": " "}}, 400, "non-empty"),
    ("wrong type", {"inputs": {"query": 3}}, 400, "query"),
    ("no inputs", {"query": "hi"}, 422, "inputs"),
    ("inputs not an object", {"inputs": "hi"}, 422, "inputs"),
]


@pytest.mark.parametrize("name,body,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_pipeline_requests(client, name, body, status, needle):
    r = client.post("/pipelines/assistant", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_invalid_pipeline_yaml_is_reported(client, repo):
    listing = client.get("/pipelines").json()
    assert [p["name"] for p in listing["pipelines"]] == ["assistant"]
    err = listing["errors"]["broken"]
    # Named relative to the repository (issue 16), never by the server's absolute path.
    assert err.startswith("broken/pipeline.yaml") and "'nodes'" in err and "cycle" in err, err
    assert str(repo) not in err
    r = client.post("/pipelines/broken", json={"inputs": {"q": "hi"}})
    assert r.status_code == 404 and "cycle" in r.json()["error"]["message"]
    assert client.post("/pipelines/nope", json={"inputs": {"q": "hi"}}).status_code == 404
    # Fix it and reload it at run time.
    (repo / "broken" / "pipeline.yaml").write_text(
        "inputs: {q: text}\n"
        "nodes:\n"
        "  - {name: a, model: minilm, inputs: {text: input.q}}\n"
        "  - {name: b, step: normalize, inputs: {vector: a.vector}}\n"
        "outputs: {v: b.vector}\n")
    assert client.post("/pipelines/broken/reload").status_code == 200
    r = client.post("/pipelines/broken", json={"inputs": {"q": "hi"}})
    assert r.status_code == 200 and len(r.json()["outputs"]["v"]) == 384
