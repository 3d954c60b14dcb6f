"""The inputs of a decoder model's KServe routes (Triton's vLLM-backend tensors on /infer, the generate
extension), against a real `surge serve` process with tritonclient (HTTP and gRPC) and httpx.

A sampling value of the wrong type or range must be refused at the edge, naming its field: one that
reached the engine failed inside the decode step, and with it every other request sharing the step."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest

tg = pytest.importorskip("tritonclient.grpc")
th = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.decoder_models import build_model  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

MODEL = "chat-qwen"
TIMEOUT = 180  # generous: a busy 2-core machine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("chatmodel") / MODEL, seed=4, hidden_size=128,
                       intermediate_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def server(model_dir):
    # cache off: the in-flight requests below must really run in the engine, not come from a cache
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "cache_entries=0", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    c = tg.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def _bytes_input(mod, name: str, *values: str):
    t = mod.InferInput(name, [len(values)], "BYTES")
    t.set_data_from_numpy(np.array([v.encode() for v in values], dtype=object))
    return t


def _infer_body(sampling: str | None = None, parameters: dict | None = None) -> dict:
    inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["bad one"]}]
    if sampling is not None:
        inputs.append({"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": [sampling]})
    return {"inputs": inputs, **({"parameters": parameters} if parameters is not None else {})}


# (field, bad value): types the engine's sampler cannot take, and ranges the generate extension refuses
BAD_SAMPLING = [("seed", "x"), ("seed", 1.5), ("top_k", 1.5), ("stop", [5]), ("stop", {"a": 1}),
                ("stop_token_ids", ["a"]), ("max_tokens", 2.5), ("max_tokens", True), ("min_tokens", 1.5),
                ("ignore_eos", "x"), ("temperature", 5), ("repetition_penalty", 0), ("logit_bias", [1]),
                ("logit_bias", {"1": "x"}), ("skip_special_tokens", "x"), ("include_stop_str_in_output", "x")]


def _refused(http, body: dict, needle: str) -> str | None:
    """None if the infer request is a 400 whose message names `needle`, else what came instead."""
    try:
        r = http.post(f"/v2/models/{MODEL}/infer", json=body)
    except httpx.HTTPError as exc:  # a server error can cost the connection
        return f"{type(exc).__name__}: {exc}"
    if r.status_code == 400 and needle in r.json().get("error", ""):
        return None
    return f"{r.status_code} {r.text[:150]}"


def _stream_generate(base_url: str, prompt: str, out: dict) -> None:
    """A valid streamed generation (generate_stream); `out["first"]` is set once its first event came."""
    text, last = [], None
    with httpx.stream("POST", base_url + f"/v2/models/{MODEL}/generate_stream", timeout=TIMEOUT,
                      json={"text_input": prompt, "parameters": {"max_tokens": 150, "temperature": 0,
                                                                 "ignore_eos": True}}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[6:])
                text.append(last.get("text_output", ""))
                out["first"].set()
    out["first"].set()
    out["text"], out["last"] = "".join(text), last


def test_bad_sampling_values_are_refused_and_spare_requests_in_flight(server, http, grpc_client):
    prompts = ["The augmented assignment", "A list comprehension"]
    solo = []
    for p in prompts:
        r = http.post(f"/v2/models/{MODEL}/generate",
                      json={"text_input": p, "parameters": {"max_tokens": 150, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        solo.append(r.json()["text_output"])
    # valid generations in flight while the bad requests come
    runs = [{"first": threading.Event()} for _ in prompts]
    threads = [threading.Thread(target=_stream_generate, args=(server.url, p, o)) for p, o in zip(prompts, runs)]
    for t in threads:
        t.start()
    for o in runs:
        assert o["first"].wait(TIMEOUT)
    failures = []
    for field, value in BAD_SAMPLING:
        sampling = json.dumps({"max_tokens": 50, "temperature": 1.0, field: value})
        if got := _refused(http, _infer_body(sampling), field):
            failures.append(f"HTTP sampling_parameters {field}={value!r}: {got}")
        # the same in the request's parameters (as the generate extension's body)
        if got := _refused(http, _infer_body(parameters={"max_tokens": 50, "temperature": 1.0, field: value}), field):
            failures.append(f"HTTP parameters {field}={value!r}: {got}")
        try:
            grpc_client.infer(MODEL, [_bytes_input(tg, "text_input", "bad one"),
                                      _bytes_input(tg, "sampling_parameters", sampling)], client_timeout=TIMEOUT)
            failures.append(f"gRPC sampling_parameters {field}={value!r}: accepted")
        except InferenceServerException as exc:
            if exc.status() != "StatusCode.INVALID_ARGUMENT" or field not in exc.message():
                failures.append(f"gRPC sampling_parameters {field}={value!r}: {exc.status()} {exc.message()[:150]}")
    # gRPC request parameters arrive typed (tritonclient sends str, int and bool)
    for field, value in [("seed", "x"), ("max_tokens", True), ("ignore_eos", "x"), ("top_k", "3")]:
        try:
            grpc_client.infer(MODEL, [_bytes_input(tg, "text_input", "bad one")], client_timeout=TIMEOUT,
                              parameters={"temperature": 1, "max_tokens": 20, field: value})
            failures.append(f"gRPC parameters {field}={value!r}: accepted")
        except InferenceServerException as exc:
            if exc.status() != "StatusCode.INVALID_ARGUMENT" or field not in exc.message():
                failures.append(f"gRPC parameters {field}={value!r}: {exc.status()} {exc.message()[:150]}")
    # a JSON string nested too deep for the parser's recursion is a bad request, not a server error
    deep = "[" * 100_000 + "]" * 100_000
    if got := _refused(http, _infer_body(deep), "sampling_parameters"):
        failures.append(f"HTTP deeply nested sampling_parameters: {got}")
    try:
        grpc_client.infer(MODEL, [_bytes_input(tg, "text_input", "bad one"),
                                  _bytes_input(tg, "sampling_parameters", deep)], client_timeout=TIMEOUT)
        failures.append("gRPC deeply nested sampling_parameters: accepted")
    except InferenceServerException as exc:
        if exc.status() != "StatusCode.INVALID_ARGUMENT":
            failures.append(f"gRPC deeply nested sampling_parameters: {exc.status()} {exc.message()[:150]}")
    for t in threads:
        t.join(TIMEOUT)
    for want, o in zip(solo, runs):  # the valid requests are whole and as they are alone
        if o.get("status") != 200 or o.get("text") != want or (o.get("last") or {}).get("finish_reason") != "length":
            failures.append(f"valid request in flight: {o.get('status')} {o.get('last')}")
    assert not failures, "\n".join(failures)
    # and valid sampling values still work on both protocols
    sampling = json.dumps({"max_tokens": 4, "temperature": 0, "seed": 3, "stop": ["zzz"], "top_k": 5,
                           "ignore_eos": True, "logit_bias": {"7": 1.5}, "repetition_penalty": 1.1})
    r = http.post(f"/v2/models/{MODEL}/infer", json=_infer_body(sampling))
    assert r.status_code == 200, r.text
    g = grpc_client.infer(MODEL, [_bytes_input(tg, "text_input", "bad one"),
                                  _bytes_input(tg, "sampling_parameters", sampling)], client_timeout=TIMEOUT)
    assert g.as_numpy("text_output")[0].decode() == r.json()["outputs"][0]["data"][0]


def test_generate_extension_honours_logit_bias(http, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt, bias = "The target list", {"7": 100}
    want = tok.decode([7, 7, 7], skip_special_tokens=True)
    for body in ({"text_input": prompt, "parameters": {"max_tokens": 3, "temperature": 0, "logit_bias": bias}},
                 {"text_input": prompt, "max_tokens": 3, "temperature": 0, "logit_bias": bias}):
        r = http.post(f"/v2/models/{MODEL}/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == want, body
    # as /v1/completions takes it
    c = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                            "logit_bias": bias})
    assert c.status_code == 200 and c.json()["choices"][0]["text"] == want, c.text
    r = http.post(f"/v2/models/{MODEL}/generate", json={"text_input": prompt, "parameters": {
        "max_tokens": 3, "logit_bias": {"not-a-token": 1}}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"], r.text


def test_binary_data_flags_must_be_json_booleans(http):
    base = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hello"]},
                       {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1],
                        "data": [json.dumps({"max_tokens": 2, "temperature": 0})]}]}
    r = http.post(f"/v2/models/{MODEL}/infer", json={**base, "parameters": {"binary_data_output": "false"}})
    assert r.status_code == 400 and "binary_data_output" in r.json()["error"], (r.status_code, r.content[:200])
    r = http.post(f"/v2/models/{MODEL}/infer",
                  json={**base, "outputs": [{"name": "text_output", "parameters": {"binary_data": "no"}}]})
    assert r.status_code == 400 and "binary_data" in r.json()["error"], (r.status_code, r.content[:200])
    # JSON booleans keep their meaning
    r = http.post(f"/v2/models/{MODEL}/infer", json={**base, "parameters": {"binary_data_output": False}})
    assert r.status_code == 200 and "data" in r.json()["outputs"][0], r.text
    r = http.post(f"/v2/models/{MODEL}/infer",
                  json={**base, "outputs": [{"name": "text_output", "parameters": {"binary_data": True}}]})
    assert r.status_code == 200 and "inference-header-content-length" in r.headers


def test_duplicate_text_input_is_refused(http, grpc_client):
    for mod in (th, tg):
        inputs = [_bytes_input(mod, "text_input", "first"), _bytes_input(mod, "text_input", "second")]
        if mod is th:
            c = th.InferenceServerClient(http.base_url.netloc.decode(), network_timeout=TIMEOUT)
            try:
                with pytest.raises(InferenceServerException, match="text_input"):
                    c.infer(MODEL, inputs)
            finally:
                c.close()
        else:
            with pytest.raises(InferenceServerException, match="text_input") as exc:
                grpc_client.infer(MODEL, inputs, client_timeout=TIMEOUT)
            assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    r = http.post(f"/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["first"]},
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["second"]}]})
    assert r.status_code == 400 and "twice" in r.json()["error"], r.text
