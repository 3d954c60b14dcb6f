"""The python backend without a server: a worker whose restart fails answers 503 with the
reason, and outputs that break the declared contract fail their own request only."""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time

import numpy as np

from surge.config import BatchingConfig, EngineConfig
from surge.errors import EngineError, NotReady
from surge.models.tensor_config import TensorModelOptions
from surge.runtime.python_worker import PythonBackend
from surge.runtime.tensor_loader import build_tensor_service

FLAKY = '''
import os
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):
        marker = Path(args["model_repository"]) / "started"
        if marker.exists():
            raise RuntimeError("second start: the GPU is gone")
        marker.write_text("1")

    def execute(self, requests):
        if requests[0].input("x")[0, 0] > 100:
            os._exit(7)
        return [{"y": r.input("x")} for r in requests]
'''

SHAPES = '''
import numpy as np


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = r.input("x")
            out.append({"y": x[:, :2] if x[0, 0] < 0 else x})  # wrong shape for negative inputs
        return out
'''


def test_a_crash_whose_restart_fails_makes_later_requests_503_with_the_reason(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(FLAKY))
    b = PythonBackend("flaky", path, "TritonPythonModel", {"model_repository": str(tmp_path)}, instances=1,
                      timeout_s=10, init_timeout_s=30)
    try:
        x = np.ones((1, 4), np.float32)
        assert np.array_equal(b.run_requests([{"x": x}])[0]["y"], x)
        crash = b.run_requests([{"x": x * 1000}])[0]
        assert isinstance(crash, EngineError) and "exited with code 7" in crash.message
        later = b.run_requests([{"x": x}])[0]
        assert isinstance(later, NotReady) and "second start: the GPU is gone" in later.message
        assert "restart failed" in b.last_error
    finally:
        b.close()


def test_outputs_off_the_contract_fail_their_own_request(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(SHAPES))
    opts = TensorModelOptions(inputs=[{"name": "x", "datatype": "FP32", "dims": [4]}],
                              outputs=[{"name": "y", "datatype": "FP32", "dims": [4]}], max_batch_size=8)
    rng = np.random.default_rng(0)
    xs = [np.abs(rng.standard_normal((2, 4))).astype(np.float32) for _ in range(3)]
    xs[1] = -xs[1]

    async def run():
        s = build_tensor_service("shapes", "1", "python", path, opts, EngineConfig(),
                                 BatchingConfig(max_batch_size=8, max_queue_delay_ms=30), None, None)
        await s.warmup()
        s.mark_ready()
        got = await asyncio.gather(*[s.infer({"x": x}) for x in xs], return_exceptions=True)
        await s.close()
        return got

    got = asyncio.run(run())
    assert isinstance(got[1], EngineError) and "with shape [2, 2], expected [2, 4]" in got[1].message
    for i in (0, 2):
        np.testing.assert_array_equal(got[i].outputs["y"], xs[i])


# BYTES outputs as Triton's python backend takes them: an object array of str (the usual idiom) or
# bytes. Other element types cannot go out as BYTES: their own request fails, naming the output.
STRINGS = '''
import numpy as np


class Weird:
    pass


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            k, n = int(r.input("x")[0, 0]), r.input("x").shape[0]
            element = {0: "cat", 1: "naïve", 2: b"raw", 3: 7, 4: {"a": 1}, 5: Weird(), 6: np.str_("np")}[k]
            out.append({"s": np.array([[element]] * n, dtype=object)})
        return out
'''


def test_bytes_outputs_take_str_elements_and_other_types_fail_their_own_request(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(STRINGS))
    opts = TensorModelOptions(inputs=[{"name": "x", "datatype": "FP32", "dims": [1]}],
                              outputs=[{"name": "s", "datatype": "BYTES", "dims": [1]}], max_batch_size=8)

    async def run():
        s = build_tensor_service("strings", "1", "python", path, opts, EngineConfig(),
                                 BatchingConfig(max_batch_size=8, max_queue_delay_ms=30), None, None)
        await s.warmup()
        s.mark_ready()
        got = await asyncio.gather(*[s.infer({"x": np.full((1, 1), k, np.float32)}) for k in range(7)],
                                   return_exceptions=True)
        await s.close()
        return got

    got = asyncio.run(run())
    for k, want in ((0, b"cat"), (1, "naïve".encode()), (2, b"raw"), (6, b"np")):
        assert not isinstance(got[k], BaseException), got[k]
        a = got[k].outputs["s"]
        assert a.dtype == object and a.tolist() == [[want]] and type(a[0, 0]) is bytes
    for k, kind in ((3, "int"), (4, "dict"), (5, "Weird")):
        assert isinstance(got[k], EngineError), got[k]
        assert "output 's'" in got[k].message and kind in got[k].message, got[k].message


# initialize reads a mode file: "raise" fails; "hang" writes a marker, then waits for another mode.
MODED = '''
import os, time
from pathlib import Path


def mode(path):
    return path.read_text().strip() if path.exists() else "ok"


class TritonPythonModel:
    def initialize(self, args):
        path = Path(args["model_repository"]) / "mode"
        if mode(path) == "hang":
            (path.parent / "hanging").write_text(str(os.getpid()))
        while mode(path) == "hang":
            time.sleep(0.05)
        if mode(path) == "raise":
            raise RuntimeError("the device is gone")

    def execute(self, requests):
        if requests[0].input("x")[0, 0] > 100:
            os._exit(7)
        return [{"y": r.input("x"), "pid": os.getpid()} for r in requests]
'''


def _until(check, timeout_s: float = 60.0) -> bool:
    end = time.monotonic() + timeout_s
    while not check() and time.monotonic() < end:
        time.sleep(0.05)
    return check()


def test_a_down_worker_leaves_the_others_serving_and_close_ends_its_hung_restart(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODED))
    b = PythonBackend("moded", path, "TritonPythonModel", {"model_repository": str(tmp_path)}, instances=2,
                      timeout_s=10, init_timeout_s=600)
    closer = None
    try:
        x = np.ones((1, 4), np.float32)
        assert np.array_equal(b.run_requests([{"x": x}])[0]["y"], x)
        (tmp_path / "mode").write_text("raise")
        crash = b.run_requests([{"x": x * 1000}])[0]
        assert isinstance(crash, EngineError) and "exited with code 7" in crash.message
        # One worker is down (its restart failed); the other one serves every request, and the model is
        # available. The down one's background restarts now hang in initialize (init_timeout_s: 600 s).
        (tmp_path / "mode").write_text("hang")
        pids = set()
        for _ in range(4):
            got = b.run_requests([{"x": x}])[0]
            assert not isinstance(got, BaseException), got
            pids.add(int(got["pid"]))
        assert len(pids) == 1 and b.available and b.unavailable_reason == ""
        assert _until(lambda: (tmp_path / "hanging").exists())
        # Unloading while a restart hangs in initialize ends it at once, not after init_timeout_s.
        closer = threading.Thread(target=b.close)
        closer.start()
        closer.join(60)
        assert not closer.is_alive()
    finally:
        if closer is None:
            b.close()


def test_every_worker_down_is_503_at_once_then_back_in_the_background(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODED))
    b = PythonBackend("moded", path, "TritonPythonModel", {"model_repository": str(tmp_path)}, instances=1,
                      timeout_s=10, init_timeout_s=600)
    try:
        x = np.ones((1, 4), np.float32)
        pid = b.run_requests([{"x": x}])[0]["pid"]
        (tmp_path / "mode").write_text("raise")
        assert isinstance(b.run_requests([{"x": x * 1000}])[0], EngineError)
        assert not b.available and "the device is gone" in b.unavailable_reason
        (tmp_path / "mode").write_text("hang")
        assert _until(lambda: (tmp_path / "hanging").exists())
        # A background start hangs now: a request does not wait for it (init_timeout_s is 600 s).
        got = b.run_requests([{"x": x}])[0]
        assert isinstance(got, NotReady) and "not ready" in got.message and "restarting" in got.message
        (tmp_path / "mode").write_text("ok")
        assert _until(lambda: b.available)
        got = b.run_requests([{"x": x}])[0]
        assert np.array_equal(got["y"], x) and int(got["pid"]) != int(pid)
    finally:
        b.close()
