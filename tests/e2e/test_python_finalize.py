"""A python model's finalize() runs when its version is unloaded, replaced by a reload, and when
the server stops on SIGTERM (repository and single-model serving), in a real `surge serve`."""

from __future__ import annotations

import shutil
import time

import httpx
import numpy as np

from tests.server_process import ServerProcess
from tests.tensor.repo import write

# finalize appends "<version> <pid>" to the marker file named in the model's parameters.
FIN_PY = '''
import os
import numpy as np


class TritonPythonModel:
    def initialize(self, args):
        self.marker = args["parameters"]["marker"]
        self.version = args["model_version"]

    def execute(self, requests):
        return [{"y": (r.input("x") + 1).astype(np.float32), "pid": np.array([[os.getpid()]], dtype=np.int64)}
                for r in requests]

    def finalize(self):
        with open(self.marker, "a") as f:
            f.write(f"{self.version} {os.getpid()}\\n")
'''

DECL = """kind: python
tensor:
  parameters: {marker: "%s"}
  inputs: [{name: x, datatype: FP32, dims: [2]}]
  outputs: [{name: y, datatype: FP32, dims: [2]}, {name: pid, datatype: INT64, dims: [1]}]
"""


def _infer(url: str, model: str = "fin") -> tuple[str, int]:
    """(version that answered, pid of its worker), checking the answer."""
    x = np.random.default_rng().normal(size=(1, 2)).astype(np.float32)
    r = httpx.post(f"{url}/v2/models/{model}/infer", timeout=30, json={
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": x.ravel().tolist()}]})
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    np.testing.assert_allclose(out["y"]["data"], (x + 1).ravel(), rtol=1e-6)
    return r.json()["model_version"], int(out["pid"]["data"][0])


def _lines(marker, n: int, timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = marker.read_text().splitlines() if marker.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    return marker.read_text().splitlines() if marker.exists() else []


def test_finalize_on_reload_unload_and_sigterm(tmp_path):
    marker = tmp_path / "finalized.txt"
    root = tmp_path / "repo"
    write(root / "fin" / "1" / "model.py", FIN_PY)
    write(root / "fin" / "1" / "model.yaml", DECL % marker)
    srv = ServerProcess("--model-repository", str(root))
    with srv:
        version, pid1 = _infer(srv.url)
        assert version == "1" and not marker.exists()
        # reload onto a new version: the old one is drained, then finalized
        shutil.copytree(root / "fin" / "1", root / "fin" / "2")
        assert httpx.post(srv.url + "/models/fin/reload", timeout=60).status_code == 200
        version, pid2 = _infer(srv.url)
        assert version == "2" and pid2 != pid1
        assert _lines(marker, 1) == [f"1 {pid1}"]
        # unload: finalized
        assert httpx.post(srv.url + "/models/fin/unload", timeout=60).status_code == 200
        assert _lines(marker, 2) == [f"1 {pid1}", f"2 {pid2}"]
        assert httpx.post(srv.url + "/models/fin/load", timeout=60).status_code == 200
        _, pid3 = _infer(srv.url)
    # SIGTERM (to the server's process group, as a terminal or a container runtime sends it)
    assert srv.proc is None or srv.proc.returncode is not None
    assert _lines(marker, 3) == [f"1 {pid1}", f"2 {pid2}", f"2 {pid3}"]


def test_finalize_on_sigterm_in_single_model_serving(tmp_path):
    marker = tmp_path / "finalized.txt"
    model = write(tmp_path / "single" / "model.py", FIN_PY)
    write(tmp_path / "single" / "model.yaml", DECL % marker)
    with ServerProcess(str(model)) as srv:
        _, pid = _infer(srv.url, "single")
        assert not marker.exists()
    assert _lines(marker, 1) == [f"1 {pid}"]
