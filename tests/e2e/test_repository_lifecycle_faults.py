"""Repository lifecycle calls that go wrong on the client's side, in a real `surge serve`: a gRPC
load or unload whose deadline passes still runs to its end (the model is not left LOADING, a
retired build is still closed), as the native HTTP route's do; a version that is not ASCII digits
is a 400, not a 500."""

from __future__ import annotations

import concurrent.futures as cf
import time

import grpc
import httpx
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from tests.server_process import ServerProcess
from tests.tensor.repo import write

# initialize and finalize take a while, so that a short client deadline passes halfway through them.
SLOW_PY = '''
import time

import numpy as np


class TritonPythonModel:
    def initialize(self, args):
        self.marker = args["parameters"]["marker"]
        time.sleep(3)

    def execute(self, requests):
        if requests[0].input("x")[0, 0] > 100:  # a long call: in flight while the version is unloaded
            open(self.marker + ".busy", "w").close()
            time.sleep(3)
        return [{"y": (r.input("x") * 2).astype(np.float32)} for r in requests]

    def finalize(self):
        time.sleep(2)
        with open(self.marker, "a") as f:
            f.write("finalized\\n")
'''

DECL = """kind: python
tensor:
  parameters: {marker: "%s"}
  inputs: [{name: x, datatype: FP32, dims: [2]}]
  outputs: [{name: y, datatype: FP32, dims: [2]}]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle-repo")
    marker = root / "finalized.txt"
    write(root / "slow" / "1" / "model.py", SLOW_PY)
    write(root / "slow" / "1" / "model.yaml", DECL % marker)
    with ServerProcess("--model-repository", str(root), grpc=True) as srv:
        srv.marker = marker
        yield srv


def _state(g, name: str) -> str:
    return next(m["state"] for m in g.get_model_repository_index(as_json=True)["models"] if m["name"] == name)


def _until(fn, want, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    got = fn()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.1)
        got = fn()
    return got


def _infer(url: str, x: tuple = (1.0, 2.0)) -> int:
    r = httpx.post(f"{url}/v2/models/slow/infer", timeout=60,
                   json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": list(x)}]})
    if r.status_code == 200:
        assert r.json()["outputs"][0]["data"] == [2 * v for v in x]
    return r.status_code


def test_a_grpc_load_or_unload_past_its_deadline_still_runs_to_its_end(server):
    g = tgrpc.InferenceServerClient(server.grpc_url)
    try:
        g.unload_model("slow")
        assert _state(g, "slow") == "UNAVAILABLE"
        with pytest.raises(InferenceServerException) as e:
            g.load_model("slow", client_timeout=0.5)  # initialize alone takes 3 s
        assert e.value.status() == str(grpc.StatusCode.DEADLINE_EXCEEDED)
        # The load goes on without its caller: READY, not LOADING for ever, and serving.
        assert _until(lambda: _state(g, "slow"), "READY") == "READY"
        assert _infer(server.url) == 200
        busy = server.marker.with_name(server.marker.name + ".busy")
        with cf.ThreadPoolExecutor(1) as pool:
            long_call = pool.submit(_infer, server.url, (500.0, 1.0))
            assert _until(busy.exists, True)
            with pytest.raises(InferenceServerException) as e:
                g.unload_model("slow", client_timeout=0.5)  # the drain waits ~3 s for the call in flight
            assert e.value.status() == str(grpc.StatusCode.DEADLINE_EXCEEDED)
            assert long_call.result() == 200  # drained, not cut off
        # The unload goes on without its caller: the retired build is closed (its finalize ran).
        assert _until(lambda: server.marker.exists() and server.marker.read_text().count("finalized"), 2) == 2
        assert _state(g, "slow") == "UNAVAILABLE"
        assert _infer(server.url) in (404, 503)
    finally:
        g.close()


def test_a_version_that_is_not_ascii_digits_is_a_400(server):
    # "²".isdigit() holds but int("²") raises: this was a 500.
    for url, body in ((f"{server.url}/models/slow/load", {"version": "²"}),
                      (f"{server.url}/v2/repository/models/slow/load", {"parameters": {"version": "²"}})):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (url, r.status_code, r.text)
        assert "version must be a positive integer" in r.text
