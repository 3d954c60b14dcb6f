"""A KServe v2 request's `parameters` reach a python model as Triton's python backend hands them over:
`request.parameters()`, a JSON string of the request's parameters object. Sent with the real
tritonclient over HTTP and gRPC to a real `surge serve`; each request of a batch sees its own, and
the model's cache (on here) keys on them."""

from __future__ import annotations

import concurrent.futures as cf
import json

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from tests.server_process import ServerProcess
from tests.tensor.repo import write

# Echoes its request's parameters() back, and scales x by the "scale" parameter (1 without it).
ECHO_PY = '''
import json
import numpy as np


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            raw = r.parameters()
            assert isinstance(raw, str)
            scale = float(json.loads(raw).get("scale", 1))
            x = r.get_input_tensor_by_name("x")
            out.append({"y": x * scale, "params": np.array([[raw]] * len(x), dtype=object)})
        return out
'''

# Calls echo (BLS-style) with its own request's parameters plus one of its own, as Triton's
# pb_utils.InferenceRequest(parameters=...) does.
RELAY_PY = '''
import json
from surge.models.python_backend import client


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            params = {**json.loads(r.parameters()), "via": "relay"}
            out.append(client.infer("echo", {"x": r.input("x")}, parameters=params))
        return out
'''

DECL = """kind: python
batching: {max_batch_size: 8, max_queue_delay_ms: 50}
cache: {max_bytes: 1048576}
tensor:
  inputs: [{name: x, datatype: FP32, dims: [2]}]
  outputs: [{name: y, datatype: FP32, dims: [2]}, {name: params, datatype: BYTES, dims: [1]}]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("params-repo")
    write(root / "echo" / "1" / "model.py", ECHO_PY)
    write(root / "echo" / "1" / "model.yaml", DECL)
    write(root / "relay" / "1" / "model.py", RELAY_PY)
    write(root / "relay" / "1" / "model.yaml", DECL)
    with ServerProcess("--model-repository", str(root), grpc=True) as srv:
        yield srv


def _send(mod, client, x: np.ndarray, parameters: dict | None, model: str = "echo"):
    t = mod.InferInput("x", list(x.shape), "FP32")
    t.set_data_from_numpy(x)
    if mod is thttp:  # gevent-based: requests in flight together through async_infer, not threads
        return client.async_infer(model, [t], parameters=parameters).get_result
    pending = cf.Future()
    client.async_infer(model, [t], lambda result, error: pending.set_result((result, error)),
                       parameters=parameters)

    def result():
        res, error = pending.result(60)
        if error is not None:
            raise error
        return res
    return result


def _answer(result):
    res = result()
    params = res.as_numpy("params")[0, 0]
    return res.as_numpy("y"), json.loads(params.decode() if isinstance(params, bytes) else params)


def _infer(mod, client, x: np.ndarray, parameters: dict | None, model: str = "echo"):
    return _answer(_send(mod, client, x, parameters, model))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_request_parameters_reach_the_model(server, protocol):
    if protocol == "http":
        mod, client = thttp, thttp.InferenceServerClient(server.url.removeprefix("http://"))
    else:
        mod, client = tgrpc, tgrpc.InferenceServerClient(server.grpc_url)
    x = np.array([[1.0, -2.5]], np.float32)
    try:
        sent = {"scale": 3, "tag": f"from {protocol}", "flag": True}
        y, seen = _infer(mod, client, x, sent)
        assert seen == sent
        np.testing.assert_array_equal(y, x * 3)
        # The same tensors with other parameters (or none) are not answered from the cache.
        y, seen = _infer(mod, client, x, {"scale": 5})
        assert seen == {"scale": 5}
        np.testing.assert_array_equal(y, x * 5)
        y, seen = _infer(mod, client, x, None)
        assert seen == {}
        np.testing.assert_array_equal(y, x)
        # Requests in flight together (one batch, as the batcher forms it) each see their own.
        pending = [_send(mod, client, x + k, {"scale": k, "k": str(k)}) for k in range(1, 5)]
        got = [_answer(p) for p in pending]
        for k, (y, seen) in zip(range(1, 5), got):
            assert seen == {"scale": k, "k": str(k)}
            np.testing.assert_array_equal(y, (x + k) * k)
    finally:
        client.close()


def test_a_python_model_passes_parameters_on_to_the_model_it_calls(server):
    client = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    x = np.array([[2.0, 0.5]], np.float32)
    try:
        y, seen = _infer(thttp, client, x, {"scale": 4}, model="relay")
        assert seen == {"scale": 4, "via": "relay"}
        np.testing.assert_array_equal(y, x * 4)
    finally:
        client.close()
