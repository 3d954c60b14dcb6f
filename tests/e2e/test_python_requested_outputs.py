"""The outputs a client asks for reach a python model as Triton's python backend hands them over:
`request.requested_output_names()`, every output of the model's config when the client names none
(Triton's core fills them in). Sent with the real tritonclient over HTTP and gRPC
(InferRequestedOutput) to a real `surge serve`; the model computes only what was asked, and its cache
(on here) keys on the names, as the answer depends on them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from tests.server_process import ServerProcess
from tests.tensor.repo import write

# Returns only the outputs its request asked for, "names" being the list of them.
PICKY_PY = '''
import json
import numpy as np


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            names = r.requested_output_names()
            assert isinstance(names, list) and all(isinstance(n, str) for n in names)
            x = r.get_input_tensor_by_name("x")
            every = {"y": x * 2, "z": x * 3, "names": np.array([[json.dumps(names)]] * len(x), dtype=object)}
            out.append({n: every[n] for n in names})
        return out
'''

DECL = """kind: python
batching: {max_batch_size: 8, max_queue_delay_ms: 1}
cache: {max_bytes: 1048576}
tensor:
  inputs: [{name: x, datatype: FP32, dims: [2]}]
  outputs: [{name: y, datatype: FP32, dims: [2]}, {name: names, datatype: BYTES, dims: [1]},
            {name: z, datatype: FP32, dims: [2]}]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs-repo")
    write(root / "picky" / "1" / "model.py", PICKY_PY)
    write(root / "picky" / "1" / "model.yaml", DECL)
    with ServerProcess("--model-repository", str(root), grpc=True) as srv:
        yield srv


def _infer(mod, client, x: np.ndarray, outputs: list[str] | None):
    t = mod.InferInput("x", list(x.shape), "FP32")
    t.set_data_from_numpy(x)
    asked = None if outputs is None else [mod.InferRequestedOutput(n) for n in outputs]
    res = client.infer("picky", [t], outputs=asked)
    got = {o["name"] for o in (res.get_response()["outputs"] if mod is thttp
                               else res.get_response(as_json=True)["outputs"])}
    seen = None
    if "names" in got:
        raw = res.as_numpy("names")[0, 0]
        seen = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return res, got, seen


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_requested_output_names_reach_the_model(server, protocol):
    if protocol == "http":
        mod, client = thttp, thttp.InferenceServerClient(server.url.removeprefix("http://"))
    else:
        mod, client = tgrpc, tgrpc.InferenceServerClient(server.grpc_url)
    x = np.array([[1.0, -2.5]], np.float32) + (protocol == "grpc")  # each protocol its own cache entries
    try:
        # none named: the model is asked for all of its outputs, and answers all of them
        res, got, seen = _infer(mod, client, x, None)
        assert sorted(seen) == ["names", "y", "z"] and got == {"names", "y", "z"}
        np.testing.assert_array_equal(res.as_numpy("z"), x * 3)
        # the same tensors, two outputs named: the model sees those two (not the cached answer's three)
        res, got, seen = _infer(mod, client, x, ["names", "y"])
        assert sorted(seen) == ["names", "y"] and got == {"names", "y"}
        np.testing.assert_array_equal(res.as_numpy("y"), x * 2)
        # one output named: the model computes only it, and that is a whole answer
        res, got, _ = _infer(mod, client, x, ["z"])
        assert got == {"z"}
        np.testing.assert_array_equal(res.as_numpy("z"), x * 3)
    finally:
        client.close()
