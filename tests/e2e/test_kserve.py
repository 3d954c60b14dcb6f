"""KServe v2 / Open Inference Protocol against a real `surge serve` process,
called with the real tritonclient (HTTP and gRPC) and raw HTTP/gRPC requests.
Results must equal those of the native API (/embed) and the PyTorch reference."""

from __future__ import annotations

import struct
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.conftest import cosine_rows
from tests.server_process import ServerProcess

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-inputs", "16", "--max-body-bytes", "65536", "--threads", "2", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def clients(server):
    """Both tritonclient flavours, as (module, client) pairs."""
    h = thttp.InferenceServerClient(server.url.removeprefix("http://"), concurrency=4)
    g = tgrpc.InferenceServerClient(server.grpc_url)
    yield [(thttp, h), (tgrpc, g)]
    h.close()
    g.close()


def native(http, inputs, **options) -> np.ndarray:
    r = http.post("/embed", json={"inputs": inputs, **options})
    assert r.status_code == 200, r.text
    return np.array(r.json()["embeddings"], dtype=np.float32)


def text_input(mod, texts, shape=None):
    arr = np.array([t.encode() for t in texts], dtype=object)
    inp = mod.InferInput("text", list(shape or arr.shape), "BYTES")
    inp.set_data_from_numpy(arr.reshape(shape or arr.shape))
    return inp


def ids_inputs(mod, ids: np.ndarray, mask: np.ndarray | None):
    inp = mod.InferInput("input_ids", list(ids.shape), "INT64")
    inp.set_data_from_numpy(ids)
    out = [inp]
    if mask is not None:
        m = mod.InferInput("attention_mask", list(mask.shape), "INT64")
        m.set_data_from_numpy(mask)
        out.append(m)
    return out


def test_health_and_metadata(clients):
    for mod, c in clients:
        assert c.is_server_live() and c.is_server_ready()
        assert c.is_model_ready(MODEL) and c.is_model_ready(MODEL, "1")
        assert not c.is_model_ready("no-such-model")
        meta = c.get_server_metadata(**({"as_json": True} if mod is tgrpc else {}))
        assert meta["name"] == "surge" and "binary_tensor_data" in meta["extensions"]
        assert "model_repository" in meta["extensions"] and "statistics" in meta["extensions"]
        m = c.get_model_metadata(MODEL, **({"as_json": True} if mod is tgrpc else {}))
        assert m["name"] == MODEL and m["versions"] == ["1"]
        assert {(t["name"], t["datatype"]) for t in m["inputs"]} == {
            ("text", "BYTES"), ("input_ids", "INT64"), ("attention_mask", "INT64")}
        (out,) = m["outputs"]
        assert out["name"] == "embedding" and out["datatype"] == "FP32" and [int(d) for d in out["shape"]] == [-1, 384]
        assert c.get_model_metadata(MODEL, "1", **({"as_json": True} if mod is tgrpc else {}))["versions"] == ["1"]


def test_raw_http_health_routes(http):
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get("/v2/models/all-MiniLM-L6-v2/versions/1/ready").status_code == 200
    r = http.get("/v2/models/nope/ready")
    assert r.status_code == 404 and "nope" in r.json()["error"]


def test_text_infer_equals_native_api_and_reference(clients, http, sentences, reference_embed):
    texts = sentences[10:18]
    expected = native(http, texts)
    assert cosine_rows(expected, reference_embed(texts)).min() >= 0.99999
    for mod, c in clients:
        for shape, binary in (((8,), True), ((8, 1), False)):
            outputs = [mod.InferRequestedOutput("embedding", **({"binary_data": binary} if mod is thttp else {}))]
            inp = text_input(mod, texts, shape)
            if mod is thttp and not binary:
                inp.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object).reshape(shape),
                                        binary_data=False)
            r = c.infer(MODEL, [inp], outputs=outputs, request_id="req-42")
            got = r.as_numpy("embedding")
            assert got.dtype == np.float32 and got.shape == (8, 384)
            np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)
            resp = r.get_response(**({"as_json": True} if mod is tgrpc else {}))
            assert resp["model_name"] == MODEL and resp["model_version"] == "1" and resp["id"] == "req-42"


def test_classification_extension_on_the_embedding_output(clients, http, sentences):
    """README: an output requested with classification = k (tritonclient's class_count=k) answers BYTES
    "<value>:<index>" (no labels: an embedding has none), the k highest values of each row best first, as
    Triton's src/classification.cc does for any numeric output; it was ignored (the tensor came back)."""
    texts = sentences[20:22]
    vectors = native(http, texts)
    k = 3
    want = np.array([[f"{float(row[i]):f}:{i}".encode() for i in np.lexsort((np.arange(row.size), -row))[:k]]
                     for row in vectors.astype(np.float64)], dtype=object)
    for mod, c in clients:
        r = c.infer(MODEL, [text_input(mod, texts)], outputs=[mod.InferRequestedOutput("embedding", class_count=k)])
        got = r.as_numpy("embedding")
        assert got.shape == (2, k), (mod.__name__, got.shape)
        assert got.tolist() == want.tolist(), mod.__name__
    r = http.post(f"/v2/models/{MODEL}/infer", json={
        "inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": texts}],
        "outputs": [{"name": "embedding", "parameters": {"classification": k}}]})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["datatype"] == "BYTES" and out["shape"] == [2, k]
    assert out["data"] == [s.decode() for s in want.ravel()]
    bad = http.post(f"/v2/models/{MODEL}/infer", json={
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
        "outputs": [{"name": "embedding", "parameters": {"classification": "3"}}]})
    assert bad.status_code == 400 and "classification" in bad.json()["error"], bad.text


def test_token_ids_infer_with_mask_and_fp16(clients, http, sentences, reference_embed):
    texts = sentences[30:34]
    enc = reference_embed.tok(texts, padding=True, return_tensors="np")
    ids, mask = enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64)
    assert (mask == 0).any()  # the batch really has padding that the mask must remove
    unpadded = [row[m.astype(bool)].tolist() for row, m in zip(ids, mask)]
    expected = native(http, unpadded)
    assert cosine_rows(expected, reference_embed(texts)).min() >= 0.99999
    for mod, c in clients:
        got = c.infer(MODEL, ids_inputs(mod, ids, mask)).as_numpy("embedding")
        np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)
        half = c.infer(MODEL, ids_inputs(mod, ids, mask), parameters={"datatype": "FP16"}).as_numpy("embedding")
        assert half.dtype == np.float16
        np.testing.assert_allclose(half.astype(np.float32), expected, atol=1e-3, rtol=0)
        # Without a mask every position counts: one unpadded row alone is the same input.
        one = c.infer(MODEL, ids_inputs(mod, np.array([unpadded[0]], dtype=np.int64), None)).as_numpy("embedding")
        np.testing.assert_allclose(one[0], expected[0], atol=2e-6, rtol=0)


def test_http_json_fp16_dimensions_and_normalize(http, sentences):
    texts = sentences[40:43]
    r = http.post("/embed", json={"inputs": texts, "normalize": False, "dimensions": 64})
    expected = np.array(r.json()["embeddings"], dtype=np.float32)
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": texts}],
            "parameters": {"normalize": False, "dimensions": 64},
            "outputs": [{"name": "embedding", "parameters": {"datatype": "FP16"}}]}
    r = http.post(f"/v2/models/{MODEL}/infer", json=body)
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    assert out["datatype"] == "FP16" and out["shape"] == [3, 64]
    got = np.array(out["data"], dtype=np.float32).reshape(3, 64)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-2)


def _binary_body(texts: list[str], ask_binary: bool) -> tuple[bytes, dict]:
    raw = b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)
    header = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                          "parameters": {"binary_data_size": len(raw)}}],
              "outputs": [{"name": "embedding", "parameters": {"binary_data": ask_binary}}]}
    import json

    head = json.dumps(header).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


def test_http_binary_tensor_extension_both_ways(http, sentences):
    texts = sentences[50:53]
    expected = native(http, texts)
    body, headers = _binary_body(texts, ask_binary=True)
    r = http.post(f"/v2/models/{MODEL}/versions/1/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    import json

    head = json.loads(r.content[:n])
    (out,) = head["outputs"]
    size = out["parameters"]["binary_data_size"]
    assert size == 3 * 384 * 4 == len(r.content) - n
    got = np.frombuffer(r.content[n:], dtype="<f4").reshape(out["shape"])
    np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)
    body, headers = _binary_body(texts, ask_binary=False)
    r = http.post(f"/v2/models/{MODEL}/infer", content=body, headers=headers)
    assert r.status_code == 200 and "Inference-Header-Content-Length" not in r.headers
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]).reshape(3, 384), expected, atol=2e-6)


def _t(name, datatype, shape, data):
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


BAD_HTTP = [
    ("wrong shape", f"/v2/models/{MODEL}/infer", {"inputs": [_t("text", "BYTES", [3], ["a", "b"])]}, 400, "shape [3]"),
    ("text 2-d", f"/v2/models/{MODEL}/infer", {"inputs": [_t("text", "BYTES", [1, 2], ["a", "b"])]}, 400, "[N,1]"),
    ("wrong datatype", f"/v2/models/{MODEL}/infer", {"inputs": [_t("text", "FP32", [1], [1.0])]}, 400, "BYTES"),
    ("ids as fp32", f"/v2/models/{MODEL}/infer", {"inputs": [_t("input_ids", "FP32", [1, 2], [101.0, 102.0])]}, 400, "INT64"),
    ("ids 1-d", f"/v2/models/{MODEL}/infer", {"inputs": [_t("input_ids", "INT64", [2], [101, 102])]}, 400, "[N,L]"),
    ("mask shape", f"/v2/models/{MODEL}/infer", {"inputs": [_t("input_ids", "INT64", [1, 2], [101, 102]),
                                                           _t("attention_mask", "INT64", [1, 1], [1])]}, 400, "attention_mask"),
    ("unknown datatype", f"/v2/models/{MODEL}/infer", {"inputs": [_t("text", "STRING", [1], ["a"])]}, 400, "unknown datatype"),
    ("missing input", f"/v2/models/{MODEL}/infer", {"inputs": [_t("attention_mask", "INT64", [1, 1], [1])]}, 400, "input_ids"),
    ("no inputs", f"/v2/models/{MODEL}/infer", {"inputs": []}, 400, "missing input"),
    ("unknown input", f"/v2/models/{MODEL}/infer", {"inputs": [_t("pixels", "FP32", [1], [1.0])]}, 400, "pixels"),
    ("unknown output", f"/v2/models/{MODEL}/infer", {"inputs": [_t("text", "BYTES", [1], ["a"])],
                                                     "outputs": [{"name": "logits"}]}, 400, "logits"),
    ("bad element", f"/v2/models/{MODEL}/infer", {"inputs": [_t("input_ids", "INT64", [1, 2], [101, "x"])]}, 400, "element 1"),
    ("empty text", f"/v2/models/{MODEL}/infer", {"inputs": [_t("text", "BYTES", [2], ["ok", " "])]}, 400, "empty"),
    ("token id out of range", f"/v2/models/{MODEL}/infer", {"inputs": [_t("input_ids", "INT64", [1, 2], [101, 10**9])]}, 400, "out of range"),
    ("too many inputs", f"/v2/models/{MODEL}/infer", {"inputs": [_t("text", "BYTES", [17], ["hi"] * 17)]}, 413, "at most 16"),
    ("missing shape", f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "text", "datatype": "BYTES", "data": ["a"]}]}, 400, "shape"),
    ("bad parameter", f"/v2/models/{MODEL}/infer", {"inputs": [_t("text", "BYTES", [1], ["a"])],
                                                    "parameters": {"normalize": "yes"}}, 400, "normalize"),
    ("unknown model", "/v2/models/gpt-9/infer", {"inputs": [_t("text", "BYTES", [1], ["a"])]}, 404, "gpt-9"),
    ("unknown version", f"/v2/models/{MODEL}/versions/7/infer", {"inputs": [_t("text", "BYTES", [1], ["a"])]}, 404, "version '7'"),
]


@pytest.mark.parametrize("name,path,body,status,needle", BAD_HTTP, ids=[b[0] for b in BAD_HTTP])
def test_http_malformed_tensors_get_spec_errors(http, name, path, body, status, needle):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and needle.lower() in r.json()["error"].lower(), r.text
    ok = http.post(f"/v2/models/{MODEL}/infer", json={"inputs": [_t("text", "BYTES", [1], ["still serving"])]})
    assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"] == [1, 384]


def test_http_malformed_binary_and_json(http):
    path = f"/v2/models/{MODEL}/infer"
    body, headers = _binary_body(["hello", "world"], ask_binary=True)
    cases = [
        (body[:-3], headers, "runs past"),  # last element cut short
        (body + b"\x00" * 4, headers, "not claimed"),
        (body, {**headers, "Inference-Header-Content-Length": str(len(body) + 5)}, "does not fit"),
        (body, {**headers, "Inference-Header-Content-Length": "abc"}, "not an integer"),
        (b'{"inputs": [', {"Content-Type": "application/json"}, "not valid JSON"),
    ]
    for content, hdrs, needle in cases:
        r = http.post(path, content=content, headers=hdrs)
        assert r.status_code == 400 and needle.lower() in r.json()["error"].lower(), r.text
    r = http.post(path, json={"inputs": [_t("text", "BYTES", [1], ["x" * 70000])]})
    assert r.status_code == 413 and "error" in r.json()
    ids = np.array([[101, 2023, 102]], dtype="<i8").tobytes()
    head = (b'{"inputs":[{"name":"input_ids","datatype":"INT64","shape":[1,4],'
            b'"parameters":{"binary_data_size":24}}]}')
    r = http.post(path, content=head + ids, headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400 and "needs 32" in r.json()["error"], r.text


def _grpc_request(inputs, raw=None, model=MODEL, version="", **kw):
    from surge.server.grpc import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model, model_version=version, **kw)
    for name, datatype, shape, contents in inputs:
        t = req.inputs.add(name=name, datatype=datatype, shape=shape)
        if contents is not None:
            field, values = contents
            getattr(t.contents, field).extend(values)
    req.raw_input_contents.extend(raw or [])
    return req


def _raw_text(*texts):
    return b"".join(struct.pack("<I", len(t)) + t for t in texts)


BAD_GRPC = [
    ("wrong shape", [("text", "BYTES", [3], None)], [_raw_text(b"a", b"b")], {}, "INVALID_ARGUMENT", "shape [3]"),
    ("wrong datatype", [("text", "INT64", [1], None)], [b"\x00" * 8], {}, "INVALID_ARGUMENT", "BYTES"),
    ("byte size", [("input_ids", "INT64", [1, 3], None)], [b"\x00" * 20], {}, "INVALID_ARGUMENT", "needs 24"),
    ("raw count", [("text", "BYTES", [1], None)], [_raw_text(b"a"), b""], {}, "INVALID_ARGUMENT", "one per input"),
    ("missing input", [], [], {}, "INVALID_ARGUMENT", "missing input"),
    ("contents count", [("input_ids", "INT64", [1, 3], ("int64_contents", [101, 102]))], None, {}, "INVALID_ARGUMENT", "needs 3"),
    ("fp16 in contents", [("input_ids", "FP16", [1, 1], None)], None, {}, "INVALID_ARGUMENT", "raw_input_contents"),
    ("unknown model", [("text", "BYTES", [1], None)], [_raw_text(b"a")], {"model": "gpt-9"}, "NOT_FOUND", "gpt-9"),
    ("unknown version", [("text", "BYTES", [1], None)], [_raw_text(b"a")], {"version": "3"}, "NOT_FOUND", "version '3'"),
    ("too many", [("text", "BYTES", [17], None)], [_raw_text(*[b"hi"] * 17)], {}, "RESOURCE_EXHAUSTED", "at most 16"),
]


@pytest.mark.parametrize("name,inputs,raw,kw,code,needle", BAD_GRPC, ids=[b[0] for b in BAD_GRPC])
def test_grpc_malformed_tensors_get_status_codes(server, name, inputs, raw, kw, code, needle):
    from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(_grpc_request(inputs, raw, **kw), timeout=30)
        assert err.value.code() == getattr(grpc.StatusCode, code), err.value.details()
        assert needle.lower() in err.value.details().lower()
        ok = stub.ModelInfer(_grpc_request([("text", "BYTES", [1], ("bytes_contents", [b"still serving"]))]), timeout=30)
        assert list(ok.outputs[0].shape) == [1, 384] and len(ok.raw_output_contents[0]) == 384 * 4


def test_tritonclient_errors_on_unknown_model(clients):
    for mod, c in clients:
        with pytest.raises(InferenceServerException) as err:
            c.infer("gpt-9", [text_input(mod, ["hi"])])
        assert "gpt-9" in str(err.value)
        with pytest.raises(InferenceServerException):
            c.get_model_metadata("gpt-9")


def test_grpc_empty_model_name_is_no_model(server, http):
    """An empty name names no model over gRPC either (HTTP's /v2/models//... is a 404): it is not served
    by whichever model the registry would pick as its default."""
    from surge.server.grpc import grpc_service_pb2 as pb
    from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc

    text = [("text", "BYTES", [1], ("bytes_contents", [b"hi"]))]
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for rpc, req in [("ModelInfer", _grpc_request(text, model="")),
                         ("ModelMetadata", pb.ModelMetadataRequest(name="")),
                         ("ModelConfig", pb.ModelConfigRequest(name=""))]:
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, rpc)(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND, (rpc, err.value.details())
        # as an unknown model: not ready (Triton's ModelReady answers false for a model it does not have)
        assert stub.ModelReady(pb.ModelReadyRequest(name=""), timeout=30).ready is False
        (answer,) = list(stub.ModelStreamInfer(iter([_grpc_request(text, model="")]), timeout=30))
        assert answer.error_message and not answer.infer_response.outputs, answer
    assert http.post("/v2/models//infer", json={"inputs": [_t("text", "BYTES", [1], ["hi"])]}).status_code == 404


def test_http_binary_data_flags_must_be_json_booleans(http):
    """binary_data_output / binary_data are JSON booleans: the string "false" is not read as true."""
    body = {"inputs": [_t("text", "BYTES", [1], ["hi"])]}
    for extra, needle in [({"parameters": {"binary_data_output": "false"}}, "binary_data_output"),
                          ({"outputs": [{"name": "embedding", "parameters": {"binary_data": "no"}}]}, "binary_data")]:
        r = http.post(f"/v2/models/{MODEL}/infer", json={**body, **extra})
        assert r.status_code == 400 and needle in r.json()["error"], (r.status_code, r.content[:200])
    r = http.post(f"/v2/models/{MODEL}/infer", json={**body, "parameters": {"binary_data_output": False}})
    assert r.status_code == 200 and len(r.json()["outputs"][0]["data"]) == 384


def test_statistics_count_requests(clients, http):
    def count(c, mod):
        s = c.get_inference_statistics(MODEL, **({"as_json": True} if mod is tgrpc else {}))["model_stats"][0]
        return int(s.get("inference_count", 0)), int(s["inference_stats"]["success"].get("count", 0)), \
            int(s["inference_stats"]["fail"].get("count", 0))

    (hmod, h), (gmod, g) = clients
    before = count(h, hmod)
    assert count(g, gmod) == before
    h.infer(MODEL, [text_input(hmod, ["one", "two", "three"])])
    g.infer(MODEL, [text_input(gmod, ["four", "five"])])
    http.post("/embed", json={"inputs": ["six"]})  # every protocol counts
    bad = http.post(f"/v2/models/{MODEL}/infer", json={"inputs": [_t("input_ids", "INT64", [1, 2], [101, 10**9])]})
    assert bad.status_code == 400
    after = count(g, gmod)
    assert after == (before[0] + 6, before[1] + 3, before[2] + 1)
    r = http.get("/v2/models/stats").json()
    assert [m["name"] for m in r["model_stats"]] == [MODEL]
    assert http.get("/v2/models/gpt-9/stats").status_code == 404


def _batch_metric(http) -> tuple[float, float] | None:
    """(count, sum) of the surge_batch_size histogram, or None while no batcher exports it."""
    r = http.get("/metrics")
    if r.status_code != 200 or "surge_batch_size" not in r.text:
        return None
    count = total = 0.0
    for line in r.text.splitlines():
        if line.startswith("surge_batch_size_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("surge_batch_size_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return count, total


def test_concurrent_grpc_and_http_clients_get_their_own_answers(server, http, sentences):
    import threading

    texts = sentences[100:164]
    # normalize=true gives the model's default output under another cache key, so
    # the concurrent requests below miss the cache and really meet in the batcher.
    singles = {t: native(http, [t], normalize=True)[0] for t in texts}
    metric_before = _batch_metric(http)
    n_grpc, n_http, rounds = 32, 8, 2
    barrier = threading.Barrier(n_grpc + n_http)
    results: list[tuple[list[str], np.ndarray]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def my_texts(worker: int, round_: int) -> list[str]:
        k = 1 + (worker + round_) % 2  # requests of one and two inputs, interleaved
        start = (worker * 2 + round_ * 7) % (len(texts) - 1)
        return texts[start:start + k]

    def grpc_worker(i: int) -> None:
        try:
            c = tgrpc.InferenceServerClient(server.grpc_url)
            barrier.wait()
            for rnd in range(rounds):
                batch = my_texts(i, rnd)
                got = c.infer(MODEL, [text_input(tgrpc, batch)]).as_numpy("embedding")
                with lock:
                    results.append((batch, got))
            c.close()
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    def http_worker(i: int) -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                barrier.wait()
                for rnd in range(rounds):
                    batch = my_texts(n_grpc + i, rnd)
                    body = {"inputs": [_t("text", "BYTES", [len(batch)], batch)]}
                    r = c.post(f"/v2/models/{MODEL}/infer", json=body)
                    assert r.status_code == 200, r.text
                    got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(len(batch), 384)
                    with lock:
                        results.append((batch, got))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=grpc_worker, args=(i,)) for i in range(n_grpc)]
    threads += [threading.Thread(target=http_worker, args=(i,)) for i in range(n_http)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert len(results) == (n_grpc + n_http) * rounds  # nothing lost
    matrix = np.stack([singles[t] for t in texts])
    for batch, got in results:
        assert got.shape == (len(batch), 384)
        for text, row in zip(batch, got):
            np.testing.assert_allclose(row, singles[text], atol=1e-5, rtol=0)
            assert texts[int(np.argmax(matrix @ row))] == text  # nothing mixed up
    metric_after = _batch_metric(http)
    if metric_before is not None and metric_after is not None:
        batches = metric_after[0] - metric_before[0]
        inputs = metric_after[1] - metric_before[1]
        # Repeated texts may be answered by the cache, but every distinct one is computed once.
        distinct = {t for b, _ in results for t in b}
        assert inputs >= len(distinct)
        assert batches < inputs, "no input shared a batch with another"


def test_repository_index_unload_load(clients, http, sentences):
    (hmod, h), (gmod, g) = clients
    texts = sentences[60:62]
    before = g.infer(MODEL, [text_input(gmod, texts)]).as_numpy("embedding")
    assert h.get_model_repository_index() == [{"name": MODEL, "version": "1", "state": "READY", "reason": ""}]
    h.unload_model(MODEL)
    assert not h.is_model_ready(MODEL) and not g.is_model_ready(MODEL)
    (entry,) = g.get_model_repository_index(as_json=True)["models"]
    assert entry["state"] == "UNAVAILABLE"
    assert g.get_model_repository_index(as_json=True).get("models", []) == [entry]
    r = http.post(f"/v2/models/{MODEL}/infer", json={"inputs": [_t("text", "BYTES", [1], ["a"])]})
    assert r.status_code == 404 and MODEL in r.json()["error"]
    with pytest.raises(InferenceServerException) as err:
        g.infer(MODEL, [text_input(gmod, texts)])
    assert "NOT_FOUND" in str(err.value.status())
    assert h.is_server_live() and g.is_server_live()
    with pytest.raises(InferenceServerException):
        g.load_model("gpt-9")
    g.load_model(MODEL)
    assert h.is_model_ready(MODEL) and g.is_model_ready(MODEL) and h.is_server_ready()
    after = h.infer(MODEL, [text_input(hmod, texts)]).as_numpy("embedding")
    np.testing.assert_allclose(after, before, atol=2e-6, rtol=0)
    for c in (h, g):  # a config sent along cannot be honoured: refused, not ignored
        with pytest.raises(InferenceServerException, match="not supported"):
            c.load_model(MODEL, config='{"max_batch_size": 4}')
    h.load_model(MODEL)  # reload while loaded: still serving afterwards
    np.testing.assert_allclose(g.infer(MODEL, [text_input(gmod, texts)]).as_numpy("embedding"), before, atol=2e-6)


def test_grpc_api_key():
    from surge.server.grpc import grpc_service_pb2 as pb
    from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc

    with ServerProcess("--api-key", "k-123", "--threads", "1", grpc=True) as srv, \
            grpc.insecure_channel(srv.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest()).live  # health checks stay open
        req = _grpc_request([("text", "BYTES", [1], ("bytes_contents", [b"hi"]))])
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError):
            stub.ModelInfer(req, metadata=[("authorization", "Bearer wrong")])
        ok = stub.ModelInfer(req, metadata=[("authorization", "Bearer k-123")])
        assert len(ok.raw_output_contents[0]) == 384 * 4


def test_statistics_count_fast_path_cache_hits_and_real_stage_durations(http):
    """One place records statistics: a cache hit answered by the HTTP fast path is counted
    (cache_hit, no execution), and the stages of a computed request have real durations."""
    def stats():
        return http.get(f"/v2/models/{MODEL}/stats").json()["model_stats"][0]

    text = f"a sentence for the statistics test {time.time_ns()}"
    first = http.post("/embed", json={"inputs": [text]})
    assert first.status_code == 200 and float(first.headers["x-surge-inference-ms"]) > 0
    before = stats()
    again = http.post("/embed", json={"inputs": [text]})  # plain request, in the cache: the fast path
    assert again.status_code == 200 and again.json()["embeddings"] == first.json()["embeddings"]
    after = stats()
    assert after["inference_stats"]["cache_hit"]["count"] == before["inference_stats"]["cache_hit"]["count"] + 1
    assert after["execution_count"] == before["execution_count"]
    assert after["inference_count"] == before["inference_count"] + 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert after["inference_stats"][stage]["count"] >= 1 and after["inference_stats"][stage]["ns"] > 0, stage
