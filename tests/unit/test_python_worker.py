"""The python backend without a server: a worker whose restart fails answers 503 with the
reason, and outputs that break the declared contract fail their own request only."""

from __future__ import annotations

import asyncio
import textwrap

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
