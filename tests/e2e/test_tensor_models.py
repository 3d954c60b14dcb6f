"""Tensor models (kinds onnx and python) served by a real `surge serve --model-repository`
process, called with the real tritonclient over HTTP and gRPC. ONNX results must equal
onnxruntime run directly on the same file; python models must fail request by request."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.server_process import ServerProcess
from tests.tensor.repo import build_repository


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_repository(tmp_path_factory.mktemp("tensor-repo"))


@pytest.fixture(scope="module")
def server(repo):
    with ServerProcess("--model-repository", str(repo), "--threads", "1", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def clients(server):
    h = thttp.InferenceServerClient(server.url.removeprefix("http://"), concurrency=8)
    g = tgrpc.InferenceServerClient(server.grpc_url)
    yield [(thttp, h), (tgrpc, g)]
    h.close()
    g.close()


def tensor(mod, name, array, binary=True):
    dt = {np.float32: "FP32", np.float64: "FP64", np.int64: "INT64", np.object_: "BYTES"}[array.dtype.type]
    t = mod.InferInput(name, list(array.shape), dt)
    if mod is thttp:
        t.set_data_from_numpy(array, binary_data=binary)
    else:
        t.set_data_from_numpy(array)
    return t


def mlp_inputs(rng, n):
    return {"x": rng.standard_normal((n, 8)).astype(np.float32), "bias": rng.integers(0, 3, (n, 1)).astype(np.int64)}


def infer(mod, client, model, arrays, binary=True):
    return client.infer(model, [tensor(mod, k, v, binary) for k, v in arrays.items()])


def concurrently(mod, client, model, requests: list[dict]) -> list:
    """All requests in flight at once (so the batcher can stack them); a result or the exception per request.
    tritonclient.http is gevent-based (async_infer, no threads); the gRPC client is thread-safe."""
    def settle(fn):
        try:
            return fn()
        except InferenceServerException as exc:
            return exc
    if mod is thttp:
        pending = [client.async_infer(model, [tensor(mod, k, v) for k, v in r.items()]) for r in requests]
        return [settle(p.get_result) for p in pending]
    with cf.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: settle(lambda: infer(mod, client, model, r)), requests))


def status_of(exc: InferenceServerException) -> str:
    return str(exc.status())


def test_onnx_results_equal_onnxruntime_per_request_while_batched(repo, clients, server):
    sess = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx"))
    rng = np.random.default_rng(11)
    requests = [mlp_inputs(rng, n) for n in (1, 3, 2, 5, 1, 4, 2, 3)]
    for mod, client in clients:
        results = concurrently(mod, client, "mlp", requests)
        for req, res in zip(requests, results):
            probs, top = sess.run(["probs", "top"], req)
            np.testing.assert_allclose(res.as_numpy("probs"), probs, rtol=1e-5, atol=1e-6)
            assert (res.as_numpy("top") == top).all()
            assert res.as_numpy("probs").shape == (req["x"].shape[0], 5)
    stats = clients[0][1].get_inference_statistics("mlp")["model_stats"][0]
    assert stats["inference_count"] >= 2 * sum(r["x"].shape[0] for r in requests)


def test_onnx_json_tensors_and_requested_outputs(repo, http):
    sess = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx"))
    rng = np.random.default_rng(12)
    req = mlp_inputs(rng, 2)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 8], "data": req["x"].tolist()},
                       {"name": "bias", "datatype": "INT64", "shape": [2, 1], "data": req["bias"].ravel().tolist()}],
            "outputs": [{"name": "top"}]}
    r = http.post("/v2/models/mlp/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]
    assert [o["name"] for o in out] == ["top"]
    assert out[0]["datatype"] == "INT64" and out[0]["data"] == sess.run(["top"], req)[0].tolist()


def test_torch_kind_over_both_protocols_equals_eager(repo, clients):
    import torch

    program = torch.export.load(str(repo / "heads" / "1" / "model.pt2"))
    model = program.module()
    rng = np.random.default_rng(26)
    requests = [{"pixels": rng.standard_normal((n, 3, 16, 16)).astype(np.float32)} for n in (1, 3, 2)]
    for mod, client in clients:
        for req, res in zip(requests, concurrently(mod, client, "heads", requests)):
            with torch.no_grad():
                logits, peak = model(torch.from_numpy(req["pixels"]))
            np.testing.assert_allclose(res.as_numpy("logits"), logits.numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(res.as_numpy("peak"), peak.numpy(), rtol=1e-5, atol=1e-5)
        cfg = client.get_model_config("heads")
        backend = cfg["backend"] if mod is thttp else cfg.config.backend
        assert backend == "pytorch"


def test_fixed_shape_model_from_config_pbtxt_runs_unbatched(repo, clients):
    sess = ort.InferenceSession(str(repo / "fixed" / "1" / "model.onnx"))
    x = np.random.default_rng(13).standard_normal((2, 3)).astype(np.float32)
    for mod, client in clients:
        got = infer(mod, client, "fixed", {"x": x}).as_numpy("y")
        np.testing.assert_allclose(got, sess.run(None, {"x": x})[0], rtol=1e-6)
        with pytest.raises(InferenceServerException) as e:
            infer(mod, client, "fixed", {"x": x[None]})
        assert "expects [2, 3]" in str(e.value)
        meta = client.get_model_metadata("fixed")
        shape = meta["inputs"][0]["shape"] if mod is thttp else list(meta.inputs[0].shape)
        assert [int(d) for d in shape] == [2, 3]


@pytest.mark.parametrize("case", ["name", "datatype", "shape", "batch"])
def test_bad_tensors_are_400_and_invalid_argument(clients, case):
    rng = np.random.default_rng(14)
    req = mlp_inputs(rng, 2)
    if case == "name":
        req["z"] = req.pop("bias")
        want = "unexpected input 'z'"
    elif case == "datatype":
        req["x"] = req["x"].astype(np.float64)
        want = "datatype FP64"
    elif case == "shape":
        req["x"] = req["x"][:, :7].copy()
        want = "has shape [2, 7]"
    else:
        req = mlp_inputs(rng, 17)
        want = "batch size 17"
    for mod, client in clients:
        with pytest.raises(InferenceServerException) as e:
            infer(mod, client, "mlp", req)
        assert want in str(e.value)
        assert status_of(e.value) in ("400", "StatusCode.INVALID_ARGUMENT")


def test_wrong_byte_size_is_400(http):
    x = np.random.default_rng(15).standard_normal((1, 8)).astype(np.float32)
    header = json.dumps({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 8], "parameters": {"binary_data_size": 28}},
        {"name": "bias", "datatype": "INT64", "shape": [1, 1], "data": [1]}]}).encode()
    r = http.post("/v2/models/mlp/infer", content=header + x.tobytes()[:28],
                  headers={"Inference-Header-Content-Length": str(len(header)),
                           "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "needs 32" in r.json()["error"]


def test_model_config_for_every_kind(clients):
    for mod, client in clients:
        for name, platform_or_backend, max_batch in (("mlp", "onnxruntime", 16), ("fixed", "onnxruntime", 0),
                                                      ("scale", "python", 8), ("minilm", "surge", 64)):
            cfg = client.get_model_config(name)
            if mod is tgrpc:
                from google.protobuf import json_format

                cfg = json_format.MessageToDict(cfg.config, preserving_proto_field_name=True)
            assert cfg["name"] == name and cfg["backend"] == platform_or_backend, cfg
            assert int(cfg.get("max_batch_size", 0)) == max_batch
            assert cfg["instance_group"][0]["kind"] == "KIND_CPU"
        cfg = client.get_model_config("mlp")
        if mod is tgrpc:
            from google.protobuf import json_format

            cfg = json_format.MessageToDict(cfg.config, preserving_proto_field_name=True)
        assert [(i["name"], i["data_type"], [int(d) for d in i["dims"]]) for i in cfg["input"]] == \
            [("x", "TYPE_FP32", [8]), ("bias", "TYPE_INT64", [1])]
        assert "dynamic_batching" in cfg
        mini = client.get_model_config("minilm")
        if mod is tgrpc:
            mini = json_format.MessageToDict(mini.config, preserving_proto_field_name=True)
        assert mini["output"][0]["name"] == "embedding" and [int(d) for d in mini["output"][0]["dims"]] == [384]


def test_python_model_one_error_fails_only_its_request(clients):
    rng = np.random.default_rng(16)
    xs = [np.abs(rng.standard_normal((n, 8))).astype(np.float32) for n in (1, 2, 1, 3)]  # model.py refuses x < 0
    xs[2][0, 0] = -1.0  # this one is refused by model.py
    for mod, client in clients:
        got = [g if isinstance(g, Exception) else g.as_numpy("y")
               for g in concurrently(mod, client, "scale", [{"x": x} for x in xs])]
        for i, (x, g) in enumerate(zip(xs, got)):
            if i == 2:
                assert isinstance(g, InferenceServerException) and "must not be negative" in str(g)
                assert status_of(g) in ("400", "StatusCode.INVALID_ARGUMENT")
            else:
                assert not isinstance(g, Exception), (mod.__name__, i, str(g))
                np.testing.assert_allclose(g, x * 3, rtol=1e-6)


def test_python_raise_fails_only_the_raising_request(clients):
    rng = np.random.default_rng(17)
    xs = [np.abs(rng.standard_normal((2, 8))).astype(np.float32) for _ in range(4)]
    xs[1][0, 0] = 5000.0
    mod, client = clients[0]
    got = [g if isinstance(g, Exception) else g.as_numpy("y")
           for g in concurrently(mod, client, "scale", [{"x": x} for x in xs])]
    assert isinstance(got[1], InferenceServerException) and "ValueError: x too large" in str(got[1])
    assert status_of(got[1]) == "500"
    for i in (0, 2, 3):
        np.testing.assert_allclose(got[i], xs[i] * 3, rtol=1e-6)


def test_python_wrong_response_count_is_a_clear_500(clients):
    x = np.random.default_rng(18).standard_normal((1, 8)).astype(np.float32)
    for mod, client in clients:
        with pytest.raises(InferenceServerException) as e:
            infer(mod, client, "miscount", {"x": x})
        assert "returned 2 responses for 1 requests" in str(e.value)
        assert status_of(e.value) in ("500", "StatusCode.INTERNAL")


def test_python_hang_is_504_and_the_worker_restarts(clients, http):
    mod, client = clients[0]
    x = np.abs(np.random.default_rng(19).standard_normal((1, 8))).astype(np.float32)
    hang = x.copy()
    hang[0, 0] = 555
    with pytest.raises(InferenceServerException) as e:
        infer(mod, client, "scale", {"x": hang})
    assert status_of(e.value) == "504" and "did not finish within 1.5 s" in str(e.value)
    np.testing.assert_allclose(infer(mod, client, "scale", {"x": x}).as_numpy("y"), x * 3, rtol=1e-6)
    entry = next(m for m in http.get("/models").json()["models"] if m["name"] == "scale")
    assert entry["state"] == "READY" and "did not finish" in entry["reason"]


def test_python_crash_is_500_restarted_and_other_models_keep_serving(repo, clients, http):
    gmod, gclient = clients[1]
    x = np.abs(np.random.default_rng(20).standard_normal((1, 8))).astype(np.float32)
    crash = x.copy()
    crash[0, 0] = 777
    with pytest.raises(InferenceServerException) as e:
        infer(gmod, gclient, "scale", {"x": crash})
    assert "exited with code 3" in str(e.value) and status_of(e.value) == "StatusCode.INTERNAL"
    np.testing.assert_allclose(infer(gmod, gclient, "scale", {"x": x}).as_numpy("y"), x * 3, rtol=1e-6)
    req = mlp_inputs(np.random.default_rng(21), 2)
    probs = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx")).run(["probs"], req)[0]
    np.testing.assert_allclose(infer(gmod, gclient, "mlp", req).as_numpy("probs"), probs, rtol=1e-5, atol=1e-6)
    entry = next(m for m in http.get("/models").json()["models"] if m["name"] == "scale")
    assert "exited with code 3" in entry["reason"]


def test_failed_loads_are_named_in_get_models(http):
    models = {m["name"]: m for m in http.get("/models").json()["models"]}
    assert models["initfail"]["state"] == "UNAVAILABLE"
    assert "RuntimeError: cannot find my weights" in models["initfail"]["reason"]
    assert models["broken"]["state"] == "UNAVAILABLE" and "cannot load model.onnx" in models["broken"]["reason"]
    for name in ("mlp", "fixed", "scale", "router", "minilm", "heads"):
        assert models[name]["state"] == "READY", models[name]


def test_python_model_calls_another_model_through_the_in_process_client(repo, clients):
    sess = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx"))
    x = np.random.default_rng(22).standard_normal((3, 8)).astype(np.float32)
    probs, top = sess.run(["probs", "top"], {"x": x, "bias": np.zeros((3, 1), np.int64)})
    for mod, client in clients:
        res = infer(mod, client, "router", {"x": x})
        np.testing.assert_allclose(res.as_numpy("probs"), probs, rtol=1e-5, atol=1e-6)
        assert [v.decode() if isinstance(v, bytes) else v for v in res.as_numpy("label")] == \
            ["abcde"[i] for i in top]


def test_python_model_embeds_through_the_client(clients, http):
    texts = ["turn on the kitchen lights", "what is the weather tomorrow"]
    want = np.array(http.post("/embed", json={"inputs": texts, "model": "minilm"}).json()["embeddings"], np.float32)
    mod, client = clients[1]
    arr = np.array([[t.encode()] for t in texts], dtype=object)
    got = infer(mod, client, "embedder", {"text": arr}).as_numpy("vec")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_embedding_routes_refuse_tensor_models_naming_the_task(http):
    r = http.post("/v1/embeddings", json={"model": "mlp", "input": "hello"})
    assert r.status_code == 400 and "serves task 'tensor', not 'embed'" in r.text


def test_python_models_as_pipeline_steps(repo, http):
    sess = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx"))
    x = np.abs(np.random.default_rng(23).standard_normal(8)).astype(np.float32)
    r = http.post("/pipelines/scaled_route", json={"inputs": {"features": x.tolist()}})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"]
    probs, top = sess.run(["probs", "top"], {"x": x[None] * 3, "bias": np.zeros((1, 1), np.int64)})
    np.testing.assert_allclose(out["scaled"], x * 3, rtol=1e-6)
    np.testing.assert_allclose(out["probs"], probs[0], rtol=1e-5, atol=1e-6)
    assert out["label"] == ["abcde"[top[0]]] or out["label"] == "abcde"[top[0]]
    assert r.json()["models"] == {"scale": "1", "router": "1"}


def test_surge_serve_an_onnx_file(tmp_path):
    """`surge serve model.onnx`: the graph's contract, batched, results equal onnxruntime."""
    from tests.tensor.graphs import mlp_onnx

    path = tmp_path / "classifier.onnx"
    mlp_onnx(path, seed=4)
    sess = ort.InferenceSession(str(path))
    req = mlp_inputs(np.random.default_rng(24), 3)
    with ServerProcess(str(path), "--threads", "1") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        meta = c.get("/v2/models/classifier").json()
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8]},
                                  {"name": "bias", "datatype": "INT64", "shape": [-1, 1]}]
        assert c.get("/v2/models/classifier/config").json()["max_batch_size"] == 64
        client = thttp.InferenceServerClient(srv.url.removeprefix("http://"))
        try:
            res = infer(thttp, client, "classifier", req)
        finally:
            client.close()
        np.testing.assert_allclose(res.as_numpy("probs"), sess.run(["probs"], req)[0], rtol=1e-5, atol=1e-6)


def test_surge_serve_a_model_py_with_its_model_yaml(repo):
    """`surge serve DIR/1/model.py`: tensors declared by the model.yaml beside it; served as 'scale'."""
    x = np.abs(np.random.default_rng(25).standard_normal((2, 8))).astype(np.float32)
    with ServerProcess(str(repo / "scale" / "1" / "model.py"), grpc=True) as srv:
        client = tgrpc.InferenceServerClient(srv.grpc_url)
        try:
            np.testing.assert_allclose(infer(tgrpc, client, "scale", {"x": x}).as_numpy("y"), x * 3, rtol=1e-6)
            cfg = client.get_model_config("scale").config
            assert cfg.backend == "python" and cfg.max_batch_size == 8 and cfg.input[0].name == "x"
        finally:
            client.close()


def test_grpc_stream_infer_serves_tensor_models(repo, server):
    """ModelStreamInfer goes through the same dispatch: results by request id, equal to onnxruntime."""
    import queue

    sess = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx"))
    rng = np.random.default_rng(27)
    requests = {f"r{i}": mlp_inputs(rng, n) for i, n in enumerate((1, 2, 3))}
    got: queue.Queue = queue.Queue()
    client = tgrpc.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        for rid, req in requests.items():
            client.async_stream_infer("mlp", [tensor(tgrpc, k, v) for k, v in req.items()], request_id=rid)
        results = [got.get(timeout=30) for _ in requests]
    finally:
        client.stop_stream()
        client.close()
    for result, error in results:
        assert error is None, error
        req = requests[result.get_response().id]
        np.testing.assert_allclose(result.as_numpy("probs"), sess.run(["probs"], req)[0], rtol=1e-5, atol=1e-6)


def test_surge_serve_of_a_model_that_fails_its_warm_up_names_the_failure(tmp_path):
    """`surge serve bad.onnx` whose graph fails at warm-up (a Reshape of [N, 4] to [-1, 3]): the exit names the
    model and onnxruntime's error, not "the server is starting" (the load's own error handler asked the registry
    which version keeps serving, and the registry answers NotReady while the server starts)."""
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper

    from tests.server_process import free_port

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [-1, 3])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "g", [x], [y], initializer=[shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "bad.onnx")
    p = subprocess.run([sys.executable, "-m", "surge.cli.main", "serve", str(tmp_path / "bad.onnx"), "--port",
                        str(free_port()), "--grpc-port", "0"], capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "server is starting" not in out, out[-2000:]
    assert "'bad'" in out and "failed to load" in out and "Reshape" in out, out[-2000:]
