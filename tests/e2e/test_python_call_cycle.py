"""Python models that call each other (client.infer, Triton's BLS) in a cycle: the inner call that would
close the cycle is refused at once, naming the path, instead of waiting on a worker that waits on it
(a deadlock until execute's timeout_s, then 504). Calls that form no cycle go through. A real server."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.server_process import ServerProcess
from tests.tensor.repo import write

# ping: y = pong(x) + 1. pong: y = 2x, but for a negative x it asks ping first (a cycle when ping called it).
PING_PY = '''
from surge.models.python_backend import client


class TritonPythonModel:
    def execute(self, requests):
        return [{"y": client.infer("pong", {"x": r.input("x")})["y"] + 1} for r in requests]
'''

PONG_PY = '''
from surge.models.python_backend import client


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = r.input("x")
            if x[0, 0] < 0:
                x = client.infer("ping", {"x": -x})["y"]
            out.append({"y": x * 2})
        return out
'''

# timeout_s bounds the deadlock this test shows is gone (it is what ended the cycle before).
DECL = """kind: python
tensor:
  timeout_s: 30
  inputs: [{name: x, datatype: FP32, dims: [2]}]
  outputs: [{name: y, datatype: FP32, dims: [2]}]
"""


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    root = tmp_path_factory.mktemp("cycle-repo")
    for name, code in (("ping", PING_PY), ("pong", PONG_PY)):
        write(root / name / "1" / "model.py", code)
        write(root / name / "1" / "model.yaml", DECL)
    with ServerProcess("--model-repository", str(root)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def _infer(c: httpx.Client, model: str, x: np.ndarray) -> httpx.Response:
    return c.post(f"/v2/models/{model}/infer", json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})


def test_calls_without_a_cycle_go_through(http):
    x = np.array([[1.5, 2.0]], np.float32)
    r = _infer(http, "ping", x)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(r.json()["outputs"][0]["data"], (x * 2 + 1).ravel())
    # pong called from outside with a positive x calls nobody
    r = _infer(http, "pong", x)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(r.json()["outputs"][0]["data"], (x * 2).ravel())


@pytest.mark.parametrize("model, path", [("ping", "ping -> pong -> ping"), ("pong", "pong -> ping -> pong")])
def test_a_call_cycle_is_refused_at_once_naming_it(http, model, path):
    r = _infer(http, model, np.array([[-1.0, 2.0]], np.float32))
    assert r.status_code == 400, r.text
    assert "call cycle" in r.json()["error"] and path in r.json()["error"], r.text
    assert "python_backend.py" not in r.text and "model.py:" in r.text  # the user's line that called
    # Nothing was left waiting: both models answer at once.
    x = np.array([[3.0, 4.0]], np.float32)
    r = _infer(http, "ping", x)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(r.json()["outputs"][0]["data"], (x * 2 + 1).ravel())
