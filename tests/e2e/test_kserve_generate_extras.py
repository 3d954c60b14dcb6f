"""Triton's vLLM-backend request flags on a decoder model, against a real `surge serve` process: the
generate extension (POST .../generate and generate_stream, httpx) and /infer (tritonclient HTTP and
gRPC) take exclude_input_in_output and the return_* flags (finish_reason, cumulative_logprob, logprobs,
num_input_tokens, num_output_tokens) as Triton's vLLM backend does (its docs/additional_outputs.md,
src/utils/request.py); `n` other than 1 is refused rather than ignored; the generate extension's bad
input is a 400 with Triton's {"error": "..."} body, as /infer's is.

References: transformers' greedy tokens and their log-probabilities (log_softmax of the raw logits,
vLLM's default), computed here on the same seeded random model."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tg = pytest.importorskip("tritonclient.grpc")
th = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.decoder_models import build_model, load_hf  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.triton_inputs import vllm_backend_inputs  # noqa: E402

MODEL = "chat-qwen"
TIMEOUT = 180  # a busy 2-core machine
PROMPT = "The augmented assignment"
N = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("genextras") / MODEL, seed=4, hidden_size=128,
                       intermediate_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "cache_entries=0", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def ref(model_dir):
    """transformers' greedy answer to PROMPT: (prompt ids, new ids, text, per new token its log-probability
    distribution over the vocabulary)."""
    model, tok = load_hf(model_dir)
    ids = tok(PROMPT)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(lg[0].double(), -1) for lg in out.logits]
    return ids, new, tok.decode(new, skip_special_tokens=True), lps, tok


def _check_logprobs(entries: list[dict], ref, k: int, start: int = 0) -> None:
    """vLLM's logprobs (one {token id: {logprob, rank, decoded_token}} per new token: the chosen one and the
    top k) against transformers'."""
    _, new, _, lps, tok = ref
    for j, entry in enumerate(entries):
        pos = start + j
        dist = lps[pos]
        top = torch.topk(dist, k).indices.tolist() if k else []
        assert set(map(int, entry)) == {new[pos], *top}, (pos, entry)
        for tid, info in entry.items():
            t = int(tid)
            assert info["logprob"] == pytest.approx(dist[t].item(), abs=2e-3)
            assert info["rank"] == int((dist > dist[t]).sum().item()) + 1
            assert info["decoded_token"] == tok.decode([t])


def test_generate_returns_tritons_additional_outputs(http, ref):
    ids, new, text, lps, _ = ref
    body = {"text_input": PROMPT, "parameters": {"max_tokens": N, "temperature": 0, "logprobs": 2},
            "return_finish_reason": True, "return_cumulative_logprob": True, "return_logprobs": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True}
    r = http.post(f"/v2/models/{MODEL}/generate", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["text_output"] == text  # surge's default: the completion only (see the module's doc)
    assert got["finish_reason"] == ("length" if len(new) == N else "stop")
    assert got["num_input_tokens"] == len(ids) and got["num_output_tokens"] == len(new)
    want_cum = sum(lps[i][t].item() for i, t in enumerate(new))
    assert got["cumulative_logprob"] == pytest.approx(want_cum, abs=1e-2)
    assert isinstance(got["logprobs"], str)  # a BYTES output: the JSON text, as the vLLM backend sends it
    entries = json.loads(got["logprobs"])
    assert len(entries) == len(new)
    _check_logprobs(entries, ref, 2)
    # the flags may also sit in `parameters` (surge merges both levels), and without them nothing extra comes
    r = http.post(f"/v2/models/{MODEL}/generate", json={"text_input": PROMPT, "parameters": {
        "max_tokens": N, "temperature": 0, "return_cumulative_logprob": True}})
    assert r.json()["cumulative_logprob"] == pytest.approx(want_cum, abs=1e-2)
    plain = http.post(f"/v2/models/{MODEL}/generate", json={"text_input": PROMPT, "max_tokens": N,
                                                             "temperature": 0}).json()
    assert not {"cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens"} & set(plain)


def test_generate_exclude_input_in_output(http, ref):
    _, _, text, _, _ = ref
    base = {"text_input": PROMPT, "parameters": {"max_tokens": N, "temperature": 0}}
    r = http.post(f"/v2/models/{MODEL}/generate", json={**base, "exclude_input_in_output": False})
    assert r.status_code == 200 and r.json()["text_output"] == PROMPT + text, r.text
    r = http.post(f"/v2/models/{MODEL}/generate", json={**base, "exclude_input_in_output": True})
    assert r.json()["text_output"] == text
    # the vLLM backend: a stream never repeats the prompt, and asking it to is an error
    r = http.post(f"/v2/models/{MODEL}/generate_stream", json={**base, "exclude_input_in_output": False})
    assert r.status_code == 400 and "exclude_input_in_output" in r.json()["error"], r.text


def test_generate_stream_additional_outputs_are_per_response(server, ref):
    ids, new, text, lps, _ = ref
    body = {"text_input": PROMPT, "parameters": {"max_tokens": N, "temperature": 0, "logprobs": 1},
            "return_cumulative_logprob": True, "return_logprobs": True, "return_num_input_tokens": True,
            "return_num_output_tokens": True}
    with httpx.stream("POST", server.url + f"/v2/models/{MODEL}/generate_stream", json=body, timeout=TIMEOUT) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == text
    # num_output_tokens: the tokens this response carries; logprobs: those tokens' only
    assert sum(e["num_output_tokens"] for e in events) == len(new)
    assert all(e["num_input_tokens"] == len(ids) for e in events)
    done = 0
    for e in events:
        entries = json.loads(e["logprobs"])
        assert len(entries) == e["num_output_tokens"]
        _check_logprobs(entries, ref, 1, start=done)
        done += len(entries)
        want_cum = sum(lps[i][t].item() for i, t in enumerate(new[:done]))
        assert e["cumulative_logprob"] == pytest.approx(want_cum, abs=1e-2)


def test_n_other_than_one_is_refused_not_ignored(http):
    for path in ("generate", "generate_stream"):
        r = http.post(f"/v2/models/{MODEL}/{path}", json={"text_input": PROMPT, "parameters": {"n": 2}})
        assert r.status_code == 400 and "'n'" in r.json()["error"], r.text
    r = http.post(f"/v2/models/{MODEL}/generate", json={"text_input": PROMPT, "parameters": {
        "n": 1, "max_tokens": 2}})
    assert r.status_code == 200, r.text
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]},
                       {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES",
                        "data": ['{"n": 3, "max_tokens": 2}']}]}
    r = http.post(f"/v2/models/{MODEL}/infer", json=body)
    assert r.status_code == 400 and "'n'" in r.json()["error"], r.text
    body["inputs"][1]["data"] = ['{"n": 1, "max_tokens": 2}']
    assert http.post(f"/v2/models/{MODEL}/infer", json=body).status_code == 200


BAD = [
    {"text_input": ""},
    {"parameters": {"max_tokens": 2}},
    {"text_input": "x", "parameters": {"temperature": 9}},
    {"text_input": "x", "max_tokens": "many"},
    {"text_input": "x", "return_logprobs": "yes"},
    {"text_input": "x", "parameters": {"logprobs": 99}},
    {"text_input": 5},
]


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
def test_generate_bad_input_is_a_400_with_tritons_body(http, path):
    for body in BAD:
        r = http.post(f"/v2/models/{MODEL}/{path}", json=body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert isinstance(err, str) and err, (body, r.text)
    r = http.post(f"/v2/models/{MODEL}/{path}", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_infer_cumulative_logprob_and_logprobs(server, ref):
    _, new, text, lps, _ = ref
    want_cum = sum(lps[i][t].item() for i, t in enumerate(new))
    sampling = {"max_tokens": N, "temperature": 0, "logprobs": 2}
    h = th.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=TIMEOUT)
    g = tg.InferenceServerClient(server.grpc_url)
    try:
        for c, mod in ((h, th), (g, tg)):
            r = c.infer(MODEL, vllm_backend_inputs(mod, PROMPT, sampling, return_cumulative_logprob=True,
                                                   return_logprobs=True, exclude_input_in_output=True))
            assert r.as_numpy("text_output")[0].decode() == text
            cum = r.as_numpy("cumulative_logprob")
            assert cum.dtype == np.float32 and cum.shape == (1,)
            assert float(cum[0]) == pytest.approx(want_cum, abs=1e-2)
            entries = json.loads(r.as_numpy("logprobs")[0])
            assert len(entries) == len(new)
            _check_logprobs(entries, ref, 2)
        with pytest.raises(InferenceServerException, match="return_logprobs"):
            g.infer(MODEL, vllm_backend_inputs(tg, PROMPT, sampling), outputs=[tg.InferRequestedOutput("logprobs")])
    finally:
        h.close()
        g.close()


def test_infer_stream_num_output_tokens_is_per_response(server, ref):
    """Triton: num_output_tokens counts the tokens of this response, not all so far; and a stream asked to
    include the prompt is refused (`exclude_input_in_output` false)."""
    import queue

    _, new, text, lps, _ = ref
    g = tg.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    g.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        g.async_stream_infer(MODEL, vllm_backend_inputs(tg, PROMPT, {"max_tokens": N, "temperature": 0},
                                                        stream=True, return_num_output_tokens=True,
                                                        return_cumulative_logprob=True))
        pieces, counts, cums, final = [], [], [], False
        while not final:
            result, error = got.get(timeout=TIMEOUT)
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0].decode())
            counts.append(int(result.as_numpy("num_output_tokens")[0]))
            cums.append(float(result.as_numpy("cumulative_logprob")[0]))
            final = result.get_response().parameters["triton_final_response"].bool_param
        assert "".join(pieces) == text and sum(counts) == len(new)
        assert cums[-1] == pytest.approx(sum(lps[i][t].item() for i, t in enumerate(new)), abs=1e-2)
        assert not any(math.isnan(c) for c in cums)
        g.async_stream_infer(MODEL, vllm_backend_inputs(tg, PROMPT, {"max_tokens": 2}, stream=True,
                                                        exclude_input_in_output=False))
        _, error = got.get(timeout=TIMEOUT)
        assert error is not None and "exclude_input_in_output" in str(error)
    finally:
        g.stop_stream()
        g.close()
