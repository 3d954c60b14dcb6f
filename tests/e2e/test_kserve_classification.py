"""Triton's classification extension and its statistics' execution_count, against a real `surge serve`
process with a classification model (seeded random head, 5 labels) and tritonclient over HTTP and gRPC.

- An output requested with `InferRequestedOutput(name, class_count=k)` (HTTP: the output parameter
  "classification": k; gRPC: parameters["classification"]) comes back as BYTES [N, k] of
  "<value>:<index>:<label>", the k highest values of each row best first (Triton's src/classification.cc:
  std::to_string of the value, so six decimals); the values are the model's own logits, checked against
  transformers.
- execution_count counts the batches the model ran (Triton's "model executions"), inference_count the
  inputs: a request split over several batches counts each, several requests sharing a batch count once.
  The batch count is the server's own surge_batch_size histogram, so the check holds however the
  concurrent requests happen to batch.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tg = pytest.importorskip("tritonclient.grpc")
th = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.server_process import ServerProcess  # noqa: E402
from tests.task_models import RANDOM, task_models_dir  # noqa: E402

MODEL = "cls5"
LABELS = RANDOM[MODEL][1]
TEXTS = ["turn on the kitchen lights", "play some jazz", "what is the weather tomorrow", "set a timer",
         "dim the bedroom lamp", "skip this song", "will it rain", "stop the alarm", "louder please",
         "good night"]
MAX_BATCH = 4


@pytest.fixture(scope="module")
def model_dir():
    return task_models_dir() / MODEL


@pytest.fixture(scope="module")
def server(model_dir):
    # no cache: every request must run the model; batches of at most 4 inputs, so 10 inputs take several
    with ServerProcess(str(model_dir), "--threads", "1", "--no-cache", "--max-batch-size", str(MAX_BATCH),
                       grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def clients(server):
    h = th.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=120)
    g = tg.InferenceServerClient(server.grpc_url)
    yield h, g
    h.close()
    g.close()


@pytest.fixture(scope="module")
def want(model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        return model(**tok(TEXTS, padding=True, return_tensors="pt")).logits.numpy()


def _text(mod, texts):
    x = mod.InferInput("text", [len(texts)], "BYTES")
    x.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return x


def _parse(entry) -> tuple[float, int, str | None]:
    parts = (entry.decode() if isinstance(entry, bytes) else entry).split(":")
    assert len(parts) in (2, 3), entry
    return float(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else None


@pytest.mark.parametrize("k", [1, 3, 9])
def test_classification_extension_top_k_over_http_and_grpc(clients, want, k):
    texts = TEXTS[:4]
    for c, mod in zip(clients, (th, tg)):
        logits = c.infer(MODEL, [_text(mod, texts)]).as_numpy("logits")
        np.testing.assert_allclose(logits, want[:4], atol=1e-3)
        for binary in ((True, False) if mod is th else (None,)):
            kw = {"binary_data": binary} if binary is not None else {}
            out = mod.InferRequestedOutput("logits", class_count=k, **kw)
            r = c.infer(MODEL, [_text(mod, texts)], outputs=[out])
            got = r.as_numpy("logits")
            top = min(k, len(LABELS))  # as Triton: at most the tensor's classes
            assert got.shape == (len(texts), top), (mod.__name__, got.shape)
            for row, entries in zip(logits, got):
                order = np.argsort(-row, kind="stable")[:top]
                parsed = [_parse(e) for e in entries]
                assert [i for _, i, _ in parsed] == order.tolist()
                assert [lab for _, _, lab in parsed] == [LABELS[i] for i in order]
                for (value, i, _), e in zip(parsed, entries):
                    assert value == pytest.approx(float(row[i]), abs=1e-5)
                    # std::to_string's six decimals
                    assert (e.decode() if isinstance(e, bytes) else e).startswith(f"{float(row[i]):f}:")
            meta = r.get_response()
            outs = meta["outputs"] if isinstance(meta, dict) else [
                {"name": o.name, "datatype": o.datatype} for o in meta.outputs]
            assert [(o["name"], o["datatype"]) for o in outs] == [("logits", "BYTES")]


def test_bad_classification_counts_are_refused(server, clients):
    h, g = clients
    assert "classification" in h.get_server_metadata()["extensions"]  # as Triton reports it
    for bad in (0, -2, "3", 1.5, True):
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["play jazz"]}],
                "outputs": [{"name": "logits", "parameters": {"classification": bad}}]}
        r = httpx.post(server.url + f"/v2/models/{MODEL}/infer", json=body, timeout=60)
        assert r.status_code == 400 and "classification" in r.json()["error"], (bad, r.text)
    with pytest.raises(InferenceServerException, match="classification"):
        g.infer(MODEL, [_text(tg, ["play jazz"])], outputs=[tg.InferRequestedOutput("logits", class_count=-1)])


def _stats(server) -> dict:
    s = httpx.get(server.url + f"/v2/models/{MODEL}/stats", timeout=60).json()["model_stats"][0]
    return {"inference_count": s["inference_count"], "execution_count": s["execution_count"]}


def _batches(server) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=60).text.splitlines():
        if line.startswith("surge_batch_size_count") and f'model="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_execution_count_counts_batches_not_requests(server, clients):
    h, _ = clients
    before, batches = _stats(server), _batches(server)
    # one request of 10 inputs: at least ceil(10 / 4) batches, one inference a request input
    h.infer(MODEL, [_text(th, TEXTS)])
    mid, mid_batches = _stats(server), _batches(server)
    assert mid["inference_count"] - before["inference_count"] == len(TEXTS)
    assert mid_batches - batches >= -(-len(TEXTS) // MAX_BATCH)
    assert mid["execution_count"] - before["execution_count"] == mid_batches - batches
    # concurrent one-input requests: however they batch, one execution a batch
    start = threading.Barrier(6)
    errors = []

    def one(text):
        c = th.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=120)
        try:
            start.wait()
            c.infer(MODEL, [_text(th, [text])])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=one, args=(t,)) for t in TEXTS[:6]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    after, after_batches = _stats(server), _batches(server)
    assert after["inference_count"] - mid["inference_count"] == 6
    assert after["execution_count"] - mid["execution_count"] == after_batches - mid_batches


@pytest.fixture(scope="module")
def tensor_server(tmp_path_factory):
    from tests.tensor.graphs import fixed_onnx, mlp_onnx
    from tests.tensor.repo import FIXED_PBTXT, write

    root = tmp_path_factory.mktemp("clsrepo")
    mlp_onnx(write(root / "mlp" / "1" / "model.onnx", ""))
    write(root / "mlp" / "1" / "model.yaml", "kind: onnx\n")
    fixed_onnx(write(root / "fixed" / "1" / "model.onnx", ""))
    write(root / "fixed" / "config.pbtxt", FIXED_PBTXT)
    with ServerProcess("--model-repository", str(root), "--threads", "1", grpc=True) as srv:
        yield srv, root


def test_classification_of_tensor_models_batched_and_not(tensor_server):
    """A generic tensor model has no labels: "<value>:<index>"; a batching model (max_batch_size > 0) gets
    [N, k] a row per item, a fixed-shape one [k] over its whole output; integers print as integers."""
    import onnxruntime as ort

    srv, root = tensor_server
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((3, 8)).astype(np.float32), "bias": rng.integers(0, 3, (3, 1)).astype(np.int64)}
    probs, top = ort.InferenceSession(str(root / "mlp" / "1" / "model.onnx")).run(["probs", "top"], feeds)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    (y,) = ort.InferenceSession(str(root / "fixed" / "1" / "model.onnx")).run(None, {"x": x})
    h = th.InferenceServerClient(srv.url.removeprefix("http://"), network_timeout=120)
    g = tg.InferenceServerClient(srv.grpc_url)
    try:
        for c, mod in ((h, th), (g, tg)):
            ins = []
            for name, arr in feeds.items():
                t = mod.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT64")
                t.set_data_from_numpy(arr)
                ins.append(t)
            r = c.infer("mlp", ins, outputs=[mod.InferRequestedOutput("probs", class_count=2),
                                             mod.InferRequestedOutput("top", class_count=1)])
            got = r.as_numpy("probs")
            assert got.shape == (3, 2)
            for row, entries in zip(probs, got):
                order = np.argsort(-row, kind="stable")[:2]
                assert [e.decode() for e in entries] == [f"{float(row[i]):f}:{i}" for i in order]
            # `top` is [N] (one value an item): its one class is index 0, the value itself
            assert [e.decode() for e in r.as_numpy("top").ravel()] == [f"{int(v)}:0" for v in top]
            t = mod.InferInput("x", [2, 3], "FP32")
            t.set_data_from_numpy(x)
            got = c.infer("fixed", [t], outputs=[mod.InferRequestedOutput("y", class_count=2)]).as_numpy("y")
            order = np.argsort(-y, kind="stable")[:2]
            assert got.shape == (2,) and [e.decode() for e in got] == [f"{float(y[i]):f}:{i}" for i in order]
    finally:
        h.close()
        g.close()


def test_a_task_request_caught_by_a_reload_is_answered_by_the_new_copy(server):
    """A KServe infer request looks the classifier up, then waits for its body; a reload in between retires
    that copy. The new copy answers (200, its scores), as an embedding request is answered: it was a 503."""
    from tests.http_reload import infer_across_a_reload

    reply = infer_across_a_reload(server, MODEL, TEXTS[0])
    assert reply.startswith(b"HTTP/1.1 200"), reply[:400]
