"""A python model whose worker dies and cannot start again is reported down, as Triton reports a
model whose stub died: not ready (model ready, server ready, the repository index UNAVAILABLE with
the reason), its requests answered 503 at once (no restart attempt, no init_timeout_s wait per
batch), while a background loop keeps restarting it with backoff; once initialize works again the
model is READY and serves correct results from a new worker. A real `surge serve`, real model.py."""

from __future__ import annotations

import time

import queue
import threading

import grpc
import httpx
import numpy as np
import tritonclient.grpc as tgrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server_process import ServerProcess
from tests.tensor.repo import write

# initialize reads a mode file: "ok" starts, "raise" fails, "hang" waits until the mode changes (a
# start that takes as long as the fault lasts: the server must not make requests wait for it).
# execute doubles x; x[0, 0] == 777 kills the process.
MODEL_PY = '''
import os, time
from pathlib import Path
import numpy as np


def mode(path):
    return path.read_text().strip() if path.exists() else "ok"


class TritonPythonModel:
    def initialize(self, args):
        path = Path(args["parameters"]["mode_file"])
        while mode(path) == "hang":
            time.sleep(0.05)
        if mode(path) == "raise":
            raise RuntimeError("the device is gone")

    def execute(self, requests):
        out = []
        for r in requests:
            x = r.input("x")
            if x[0, 0] == 777:
                os._exit(7)
            out.append({"y": x * 2, "pid": np.array([[os.getpid()]] * len(x), dtype=np.int64)})
        return out
'''

DECL = """kind: python
tensor:
  init_timeout_s: 600
  parameters: {mode_file: "%s"}
  inputs: [{name: x, datatype: FP32, dims: [2]}]
  outputs: [{name: y, datatype: FP32, dims: [2]}, {name: pid, datatype: INT64, dims: [1]}]
"""


def _infer(c: httpx.Client, x: np.ndarray) -> httpx.Response:
    return c.post("/v2/models/flaky/infer", json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})


def _entry(c: httpx.Client) -> dict:
    return next(m for m in c.post("/v2/repository/index", json={}).json() if m["name"] == "flaky")


def _until(check, timeout_s: float = 60.0):
    """Poll a condition of the server (its state changes in a background thread)."""
    end = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > end:
            return got
        time.sleep(0.05)


def _watch(target: str, name: str) -> tuple[queue.Queue, grpc.Channel]:
    """The gRPC health Watch of a model: each status it streams, in a queue (the server notifies it)."""
    channel = grpc.insecure_channel(target)
    seen: queue.Queue = queue.Queue()
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=name))

    def read():
        try:
            for msg in stream:
                seen.put(msg.status)
        except grpc.RpcError:  # the channel closed at the end of the test
            pass

    threading.Thread(target=read, daemon=True).start()
    return seen, channel


def _next_status(seen: queue.Queue, want: int) -> bool:
    """Whether the Watch streams `want` (statuses before it are skipped)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if seen.get(timeout=max(0.0, end - time.monotonic())) == want:
                return True
        except queue.Empty:
            return False
    return False


def test_a_worker_that_cannot_restart_is_down_then_comes_back(tmp_path):
    mode = tmp_path / "mode"
    root = tmp_path / "repo"
    write(root / "flaky" / "1" / "model.py", MODEL_PY)
    write(root / "flaky" / "1" / "model.yaml", DECL % mode)
    x = np.array([[1.5, -2.0]], np.float32)
    with ServerProcess("--model-repository", str(root), grpc=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        first = _infer(c, x)
        assert first.status_code == 200, first.text
        pid1 = first.json()["outputs"][1]["data"][0]
        watched, channel = _watch(srv.grpc_url, "flaky")
        serving, not_serving = (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _next_status(watched, serving)

        # The worker dies, and its restart fails: the crashing request is a 500 naming the exit code.
        mode.write_text("raise")
        crash = _infer(c, np.array([[777, 0]], np.float32))
        assert crash.status_code == 500 and "exited with code 7" in crash.text, crash.text

        # Down: not ready everywhere, with the reason.
        assert c.get("/v2/models/flaky/ready").status_code == 400
        assert c.get("/v2/health/ready").status_code == 400
        grpc_client = tgrpc.InferenceServerClient(srv.grpc_url)
        assert not grpc_client.is_model_ready("flaky")
        entry = _entry(c)
        assert entry["state"] == "UNAVAILABLE" and "the device is gone" in entry["reason"], entry
        assert _next_status(watched, not_serving)  # told, not polled: the worker went down in no request

        # A start that hangs now (init_timeout_s is 600 s): requests do not wait for it, they are 503 with
        # the reason (the client's 60 s timeout would end a request that waited for initialize).
        mode.write_text("hang")
        for _ in range(3):
            r = _infer(c, x)
            assert r.status_code == 503, r.text
            assert "flaky" in r.json()["error"] and "not ready" in r.json()["error"], r.text

        # initialize works again: the background restart brings the model back, on a new worker.
        mode.write_text("ok")
        assert _until(lambda: c.get("/v2/models/flaky/ready").status_code == 200)
        assert c.get("/v2/health/ready").status_code == 200
        assert grpc_client.is_model_ready("flaky")
        assert _entry(c)["state"] == "READY"
        assert _next_status(watched, serving)
        back = _infer(c, x)
        assert back.status_code == 200, back.text
        outputs = {o["name"]: o["data"] for o in back.json()["outputs"]}
        np.testing.assert_array_equal(outputs["y"], (x * 2).ravel())
        assert outputs["pid"][0] != pid1
        grpc_client.close()
        channel.close()
