"""The openai client against a real server: models.retrieve, aliases on every protocol,
2,048 inputs, inputs longer than the model, token-id inputs."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import cosine_rows
from tests.e2e.clients.conftest import ALIASES, API_KEY, AUTH, MAX_BATCH, MODEL


@pytest.fixture(scope="module")
def oa(main_server):
    return openai.OpenAI(base_url=main_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def lenient(lenient_server):
    return openai.OpenAI(base_url=lenient_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _vectors(resp) -> np.ndarray:
    return np.array([d.embedding for d in resp.data], dtype=np.float32)


def _long_text(sentences, words: int = 1500) -> str:
    out, i = [], 0
    while len(out) < words:
        out.extend(sentences[i % len(sentences)].split())
        i += 1
    return " ".join(out[:words])


def test_models_retrieve_and_list_with_aliases(oa):
    ids = [m.id for m in oa.models.list()]
    assert ids == [MODEL, *sorted(ALIASES)]
    for name in (MODEL, *ALIASES):
        m = oa.models.retrieve(name)
        assert m.id == name and m.object == "model" and m.owned_by == "surge" and m.created > 0
    with pytest.raises(openai.NotFoundError) as err:
        oa.models.retrieve("gpt-9")
    assert "gpt-9" in str(err.value)


def test_aliases_answer_on_openai_native_and_kserve(oa, main_server, reference_embed, sentences):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    texts = sentences[10:14]
    ref = reference_embed(texts)
    resp = oa.embeddings.create(model="text-embedding-3-small", input=texts)
    assert resp.model == "text-embedding-3-small"  # the name asked for, as OpenAI answers
    assert cosine_rows(_vectors(resp), ref).min() >= 0.99999
    native = httpx.post(main_server.url + "/embed", json={"inputs": texts, "model": "surge-alias"}, headers=AUTH,
                        timeout=60)
    assert native.status_code == 200, native.text
    assert cosine_rows(np.array(native.json()["embeddings"]), ref).min() >= 0.99999

    data = np.array([t.encode() for t in texts], dtype=object)
    hc = httpclient.InferenceServerClient(main_server.url.removeprefix("http://"))
    inp = httpclient.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(data)
    got = hc.infer("text-embedding-ada-002", [inp], headers=dict(AUTH)).as_numpy("embedding")
    assert cosine_rows(got, ref).min() >= 0.99999
    assert hc.is_model_ready("text-embedding-ada-002", headers=dict(AUTH))
    gc = grpcclient.InferenceServerClient(main_server.grpc_url)
    ginp = grpcclient.InferInput("text", [len(texts)], "BYTES")
    ginp.set_data_from_numpy(data)
    meta = {"authorization": f"Bearer {API_KEY}"}
    got = gc.infer("text-embedding-3-small", [ginp], headers=meta).as_numpy("embedding")
    assert cosine_rows(got, ref).min() >= 0.99999
    assert gc.get_model_metadata("surge-alias", headers=meta).name == MODEL
    hc.close()
    gc.close()


def _batch_sizes(url: str) -> tuple[float, float]:
    """(batches of at most MAX_BATCH inputs, all batches) from the server's histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    le, total = 0.0, 0.0
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "surge_batch_size":
            for s in fam.samples:
                if s.name == "surge_batch_size_bucket" and s.labels["le"] == str(float(MAX_BATCH)):
                    le += s.value
                elif s.name == "surge_batch_size_count":
                    total += s.value
    return le, total


def test_2048_inputs_in_one_request_run_in_engine_sized_batches(oa, main_server, reference_embed, sentences):
    words = " ".join(sentences[:40]).split()
    texts = [f"{words[i % len(words)]} {words[(7 * i) % len(words)]} {i}" for i in range(2048)]  # short: quick
    le0, total0 = _batch_sizes(main_server.url)
    resp = oa.embeddings.create(model="text-embedding-3-small", input=texts)
    assert [d.index for d in resp.data] == list(range(2048))
    pick = [0, 1, 777, 1500, 2047]
    got = _vectors(resp)[pick]
    assert cosine_rows(got, reference_embed([texts[i] for i in pick])).min() >= 0.99999
    le1, total1 = _batch_sizes(main_server.url)
    assert total1 - total0 >= 2048 / MAX_BATCH  # split: no batch over the server's max batch size
    assert le1 - le0 == total1 - total0
    with pytest.raises(openai.APIStatusError) as err:
        oa.embeddings.create(model="text-embedding-3-small", input=texts + ["one too many"])
    assert err.value.status_code == 413 and "at most 2048" in str(err.value)


def test_input_longer_than_the_model_is_400_unless_truncation_is_asked(oa, lenient, reference_embed, sentences):
    long = _long_text(sentences)
    full = len(reference_embed.tok(long)["input_ids"])  # transformers' own count, untruncated
    assert full > 256
    short = sentences[3]
    with pytest.raises(openai.BadRequestError) as err:
        oa.embeddings.create(model="text-embedding-3-small", input=[short, long])
    msg = err.value.body["message"]
    assert f"input 1 has {full} tokens" in msg and "256" in msg and "truncate" in msg
    # The hot path (a plain request) and the cache-hit path say the same.
    for _ in range(2):
        r = httpx.post(oa.base_url.join("embeddings").__str__(), json={"input": [long]}, headers=AUTH, timeout=60)
        assert r.status_code == 400 and f"input 0 has {full} tokens" in r.json()["error"]["message"]
    ref = reference_embed([short, long])  # the reference truncates to 256 tokens
    n_short = len(reference_embed.tok(short)["input_ids"])
    for client, extra in ((oa, {"truncate": True}), (lenient, None)):  # asked by the request / --auto-truncate
        resp = client.embeddings.create(model=MODEL, input=[short, long], extra_body=extra)
        assert cosine_rows(_vectors(resp), ref).min() >= 0.99999
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == n_short + 256  # what was computed


def test_token_ids_get_400_by_default_and_are_the_models_own_with_the_flag(oa, lenient, reference_embed):
    text = "turn on the kitchen lights"
    ids = reference_embed.tok(text)["input_ids"]
    with pytest.raises(openai.BadRequestError) as err:
        oa.embeddings.create(model="text-embedding-3-small", input=[ids])
    msg = err.value.body["message"]
    assert "expects text" in msg and "check_embedding_ctx_length=False" in msg and "--allow-token-ids" in msg
    resp = lenient.embeddings.create(model=MODEL, input=[ids, ids[:4]])
    assert cosine_rows(_vectors(resp)[:1], reference_embed([text]))[0] >= 0.99999
    with pytest.raises(openai.BadRequestError) as err:
        lenient.embeddings.create(model=MODEL, input=[[101, 10 ** 6]])
    assert "out of range" in err.value.body["message"]
