"""TEI's `truncation_direction` ("left" / "right", either capitalized, as TEI v1.9's router accepts) against
a real `surge serve --tei-embed` process: a text longer than the model keeps its last tokens under
"left", with the post-processor's [CLS] ... [SEP] still around them, on every TEI route that takes the
field (/embed, POST /, /similarity, /embed_all, /predict, /rerank; /embed_sparse checks it).

References: the `tokenizers` library's own left truncation gives the token ids (TEI truncates with the
same library), and transformers' model runs on them (mean pooling and normalization, as the bundled
all-MiniLM-L6-v2's sentence-transformers modules do; the cross-encoder's logits). Right truncation is
checked against the same references with right truncation, so the two are shown to differ.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from surge.models import bundled_model_dir
from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess
from tests.task_models import task_models_dir

ENGINE = "engine: {threads: 1, warmup_shapes: [[1, 8]]}\n"
# Each half is past the model's length, and they are about different things: the first tokens and the last
# ones embed far apart, so an answer from the wrong end fails the comparison.
HEAD = "Preheat the oven, whisk the eggs with sugar and fold in the flour for the sponge cake. " * 30
TAIL = "The rocket reached orbit and the astronauts docked with the space station at dawn. " * 30
LONG = HEAD + TAIL


@pytest.fixture(scope="module")
def models():
    return task_models_dir()


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("teitrunc")
    add_version(root, "minilm", 1, ENGINE + f"source: {bundled_model_dir()}\n")
    add_version(root, "ce", 1, ENGINE + f"source: {models / 'ce'}\n")
    with ServerProcess("--model-repository", str(root), "--threads", "1", "--tei-embed") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _max_length(client, model: str) -> int:
    r = client.get("/info", params={"model": model})
    assert r.status_code == 200, r.text
    return r.json()["max_input_length"]


def _ids(model_dir, inputs: list, max_length: int, direction: str) -> list:
    """(ids, type ids) of each text or (text, text_pair) as the `tokenizers` library truncates them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length, direction=direction)
    return [(e.ids, e.type_ids) for e in tok.encode_batch(inputs)]


class Reference:
    """transformers' all-MiniLM-L6-v2 on given token ids: last hidden states, mean-pooled unit vectors."""

    def __init__(self, max_length: int):
        import torch
        from transformers import AutoModel

        self.torch = torch
        self.model = AutoModel.from_pretrained(str(bundled_model_dir()), dtype=torch.float32).eval()
        self.max_length = max_length

    def hidden(self, text: str, direction: str) -> np.ndarray:
        ids, types = _ids(bundled_model_dir(), [text], self.max_length, direction)[0]
        t = self.torch
        with t.no_grad():
            out = self.model(input_ids=t.tensor([ids]), token_type_ids=t.tensor([types]),
                             attention_mask=t.ones(1, len(ids), dtype=t.long))
        return out.last_hidden_state[0].numpy().astype(np.float64)

    def embed(self, text: str, direction: str) -> np.ndarray:
        v = self.hidden(text, direction).mean(0)  # mean pooling (no padding: every token counts)
        return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def ref(client):
    return Reference(_max_length(client, "minilm"))


def _close(got, want, atol=2e-4):
    got = np.asarray(got, dtype=np.float64)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)


def test_reference_ids_are_the_last_tokens_between_special_tokens(ref):
    """The reference itself: left truncation keeps [CLS], the text's last tokens, [SEP] (transformers'
    tokenizer with truncation_side='left' agrees), and the two ends embed far apart."""
    from transformers import AutoTokenizer

    (left, _), = _ids(bundled_model_dir(), [LONG], ref.max_length, "left")
    (full, _), = _ids(bundled_model_dir(), [LONG], 100_000, "right")
    assert len(left) == ref.max_length and len(full) > 2 * ref.max_length
    assert left == [full[0]] + full[-(ref.max_length - 1):]  # [CLS] + the last tokens, [SEP] last
    hf = AutoTokenizer.from_pretrained(str(bundled_model_dir()), truncation_side="left")
    assert hf(LONG, truncation=True, max_length=ref.max_length)["input_ids"] == left
    assert float(ref.embed(LONG, "left") @ ref.embed(LONG, "right")) < 0.8


@pytest.mark.parametrize("spelling", ["left", "Left"])
def test_embed_and_root_truncate_from_the_left(client, ref, spelling):
    want_left, want_right = ref.embed(LONG, "left"), ref.embed(LONG, "right")
    for path in ("/embed", "/"):
        r = client.post(path, json={"model": "minilm", "inputs": [LONG], "truncation_direction": spelling})
        assert r.status_code == 200, (path, r.text)
        _close(r.json()[0], want_left)
        for right in ({"truncation_direction": "right"}, {"truncation_direction": "Right"}, {}):
            r = client.post(path, json={"model": "minilm", "inputs": [LONG], **right})
            assert r.status_code == 200, (path, r.text)
            _close(r.json()[0], want_right)


def test_inference_client_feature_extraction_left(server, ref):
    """huggingface_hub's InferenceClient sends its `truncation_direction` to POST /."""
    from huggingface_hub import InferenceClient

    c = InferenceClient(model=server.url + "/models/minilm")
    got = c.feature_extraction(LONG, truncation_direction="left")
    _close(np.asarray(got).reshape(-1), ref.embed(LONG, "left"))
    got = c.feature_extraction(LONG, truncation_direction="right")
    _close(np.asarray(got).reshape(-1), ref.embed(LONG, "right"))


def test_cache_keeps_left_and_right_apart(client, ref):
    """The hot-query cache holds both answers of one text: each direction gets its own, first asked
    or repeated (a key without the direction answers the second request with the first's vector)."""
    text = f"{uuid.uuid4().hex} {LONG} {uuid.uuid4().hex}"  # no earlier request cached it
    want = {d: ref.embed(text, d) for d in ("left", "right")}
    for d in ("right", "left", "left", "right", "left"):
        r = client.post("/embed", json={"model": "minilm", "inputs": text, "truncation_direction": d})
        assert r.status_code == 200, r.text
        _close(r.json()[0], want[d])
    # a text not cut is the same either way, and "truncate": false has no direction to honour
    short = "a short sentence " + uuid.uuid4().hex
    for d in ("left", "right"):
        r = client.post("/embed", json={"model": "minilm", "inputs": short, "truncation_direction": d,
                                        "truncate": False})
        assert r.status_code == 200, r.text
        _close(r.json()[0], ref.embed(short, "right"))
    r = client.post("/embed", json={"model": "minilm", "inputs": LONG, "truncation_direction": "left",
                                    "truncate": False})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation", r.text


def test_concurrent_left_and_right_requests_each_get_their_own(client, ref):
    """Requests of both directions arriving together (tokenized in one drain of the tokenize stage and
    computed in shared engine batches) each get the answer of their own direction."""
    texts = [f"{i} {uuid.uuid4().hex} {LONG} {i}" for i in range(6)]
    jobs = [(t, d) for t in texts for d in ("left", "right")]

    def call(job):
        t, d = job
        r = client.post("/embed", json={"model": "minilm", "inputs": [t, t[:40]], "truncation_direction": d})
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(call, jobs))
    for (t, d), got in zip(jobs, answers):
        _close(got[0], ref.embed(t, d))
        _close(got[1], ref.embed(t[:40], d))


def test_similarity_takes_the_direction_in_parameters(client, ref):
    src = "astronauts docked with the space station"
    for d in ("left", "right"):
        body = {"model": "minilm", "inputs": {"source_sentence": src, "sentences": [LONG]},
                "parameters": {"truncation_direction": d}}
        for path in ("/similarity", "/"):
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            want = float(ref.embed(src, "right") @ ref.embed(LONG, d))
            assert r.json()[0] == pytest.approx(want, abs=2e-4), (path, d)


def test_embed_all_left_is_the_hidden_state_of_the_last_tokens(client, ref):
    r = client.post("/embed_all", json={"model": "minilm", "inputs": LONG, "truncation_direction": "left"})
    assert r.status_code == 200, r.text
    rows = np.asarray(r.json()[0], dtype=np.float64)
    want = ref.hidden(LONG, "left")
    assert rows.shape == want.shape
    np.testing.assert_allclose(rows, want, atol=2e-3, rtol=0)


@pytest.fixture(scope="module")
def cross_encoder(models):
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(models / "ce"), dtype=torch.float32).eval()

    def logits(pairs: list, max_length: int, direction: str) -> list[float]:
        out = []
        for ids, types in _ids(models / "ce", pairs, max_length, direction):
            with torch.no_grad():
                out.append(float(model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types]),
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0, 0]))
        return out

    return logits


def test_rerank_and_predict_truncate_pairs_from_the_left(client, cross_encoder):
    """A (query, long document) pair: tokenizers' longest-first truncation cuts the longer side, from
    its start under "left"."""
    n = _max_length(client, "ce")
    docs = [LONG, TAIL + HEAD, "a short document"]
    for d in ("left", "right"):
        want = cross_encoder([("space station", x) for x in docs], n, d)
        r = client.post("/rerank", json={"model": "ce", "query": "space station", "texts": docs, "raw_scores": True,
                                         "truncation_direction": d})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["score"] for x in r.json()}
        assert [got[i] for i in range(len(docs))] == pytest.approx(want, abs=2e-4), d
        r = client.post("/predict", json={"model": "ce", "inputs": [["space station", x] for x in docs],
                                          "raw_scores": True, "truncation_direction": d})
        assert r.status_code == 200, r.text
        assert [x[0]["score"] for x in r.json()] == pytest.approx(want, abs=2e-4), d
    assert abs(cross_encoder([("q", LONG)], n, "left")[0] - cross_encoder([("q", LONG)], n, "right")[0]) > 1e-3


@pytest.mark.parametrize("path,body", [
    ("/embed", {"model": "minilm", "inputs": "hi"}),
    ("/", {"model": "minilm", "inputs": "hi"}),
    ("/embed_all", {"model": "minilm", "inputs": "hi"}),
    ("/embed_sparse", {"model": "minilm", "inputs": "hi"}),
    ("/predict", {"model": "ce", "inputs": ["a", "b"]}),
    ("/rerank", {"model": "ce", "query": "a", "texts": ["b"]}),
])
def test_unknown_direction_is_a_validation_error(client, path, body):
    r = client.post(path, json={**body, "truncation_direction": "middle"})
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "Validation" and "truncation_direction" in r.json()["error"], r.text


def test_unknown_direction_in_similarity_parameters(client):
    r = client.post("/similarity", json={"model": "minilm", "inputs": {"source_sentence": "a", "sentences": ["b"]},
                                         "parameters": {"truncation_direction": "middle"}})
    assert r.status_code == 422 and "truncation_direction" in r.json()["error"], r.text
