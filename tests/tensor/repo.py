"""A model repository of tensor models for the end-to-end tests: ONNX graphs
(model.yaml and config.pbtxt) and python models that misbehave on purpose."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.tensor.graphs import fixed_onnx, mlp_onnx

PY_DECL = """kind: python
batching: {max_batch_size: 8, max_queue_delay_ms: 20}
tensor:
  timeout_s: %(timeout)s
  parameters: {scale: 3}
  inputs: [{name: x, datatype: FP32, dims: [8]}]
  outputs: [{name: y, datatype: FP32, dims: [8]}]
"""

# Scales x; a request whose first value is negative gets its own error; one that is
# above 1000 makes execute raise; x[0, 0] == 555 hangs, 777 crashes the process.
SCALE_PY = '''
import os, time
import numpy as np
from surge.models.python_backend import ModelError


class TritonPythonModel:
    def initialize(self, args):
        self.scale = float(args["parameters"]["scale"])
        assert args["model_config"]["input"][0]["name"] == "x"
        self.pid = os.getpid()

    def execute(self, requests):
        out = []
        for r in requests:
            x = r.input("x")
            if x[0, 0] == 555:
                time.sleep(3600)
            if x[0, 0] == 777:
                os._exit(3)
            if x[0, 0] > 1000:
                raise ValueError("x too large")
            if x[0, 0] < 0:
                out.append(ModelError("x[0, 0] must not be negative"))
                continue
            out.append({"y": (x * self.scale).astype(np.float32)})
        return out
'''

# Business logic around another model: the mlp's probabilities for x, and their top class name.
ROUTER_PY = '''
import numpy as np
from surge.models.python_backend import InferenceResponse, client

NAMES = ["a", "b", "c", "d", "e"]


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            got = client.infer("mlp", {"x": r.input("x"), "bias": np.zeros((r.input("x").shape[0], 1), np.int64)})
            label = np.array([NAMES[i].encode() for i in got["top"]], dtype=object)
            out.append(InferenceResponse({"probs": got["probs"], "label": label}))
        return out
'''

ROUTER_DECL = """kind: python
tensor:
  max_batch_size: 8
  inputs: [{name: x, datatype: FP32, dims: [8]}]
  outputs: [{name: probs, datatype: FP32, dims: [5]}, {name: label, datatype: BYTES, dims: []}]
"""

# Calls an embedding model through the client: BYTES text in, its MiniLM vector out.
EMBEDDER_PY = '''
from surge.models.python_backend import client


class TritonPythonModel:
    def execute(self, requests):
        return [{"vec": client.embed("minilm", [t.decode() for t in r.input("text").ravel()])} for r in requests]
'''

EMBEDDER_DECL = """kind: python
tensor:
  max_batch_size: 4
  inputs: [{name: text, datatype: BYTES, dims: [1]}]
  outputs: [{name: vec, datatype: FP32, dims: [384]}]
"""

HEADS_DECL = """kind: torch
batching: {max_batch_size: 8, max_queue_delay_ms: 20}
tensor:
  outputs: [{name: logits, datatype: FP32, dims: [4]}, {name: peak, datatype: FP32, dims: []}]
"""

COUNT_PY = '''
class TritonPythonModel:
    def execute(self, requests):
        return [{"y": r.input("x")} for r in requests] + [{"y": requests[0].input("x")}]
'''

INIT_FAIL_PY = '''
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("cannot find my weights")

    def execute(self, requests):
        return []
'''

FIXED_PBTXT = """
name: "fixed"
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


# Two python models as pipeline steps: scale x by 3, then route the result through the mlp.
PIPELINE = """
inputs: {features: any}
nodes:
  - {name: scaled, model: scale, inputs: {x: input.features}}
  - {name: routed, model: router, inputs: {x: scaled.y}}
outputs: {scaled: scaled.y, label: routed.label, probs: routed.probs}
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def build_repository(root: Path, *, with_minilm: bool = True, timeout_s: float = 1.5) -> Path:
    mlp_onnx(write(root / "mlp" / "1" / "model.onnx", "") )
    write(root / "mlp" / "1" / "model.yaml", "kind: onnx\nbatching: {max_batch_size: 16, max_queue_delay_ms: 20}\n")
    fixed_onnx(write(root / "fixed" / "1" / "model.onnx", ""))
    write(root / "fixed" / "config.pbtxt", FIXED_PBTXT)
    write(root / "scale" / "1" / "model.py", SCALE_PY)
    write(root / "scale" / "1" / "model.yaml", PY_DECL % {"timeout": timeout_s})
    write(root / "router" / "1" / "model.py", ROUTER_PY)
    write(root / "router" / "1" / "model.yaml", ROUTER_DECL)
    write(root / "miscount" / "1" / "model.py", COUNT_PY)
    write(root / "miscount" / "1" / "model.yaml", PY_DECL % {"timeout": 10})
    write(root / "initfail" / "1" / "model.py", INIT_FAIL_PY)
    write(root / "initfail" / "1" / "model.yaml", PY_DECL % {"timeout": 10})
    write(root / "broken" / "1" / "model.onnx", "this is not an onnx file")
    write(root / "broken" / "1" / "model.yaml", "kind: onnx\n")
    write(root / "scaled_route" / "pipeline.yaml", PIPELINE)
    from tests.tensor.torch_models import export_two_heads  # torch.export: a few seconds

    (root / "heads" / "1").mkdir(parents=True)
    export_two_heads(root / "heads" / "1" / "model.pt2")
    write(root / "heads" / "1" / "model.yaml", HEADS_DECL)
    if with_minilm:
        write(root / "embedder" / "1" / "model.py", EMBEDDER_PY)
        write(root / "embedder" / "1" / "model.yaml", EMBEDDER_DECL)
        write(root / "minilm" / "1" / "model.yaml", "engine: {threads: 1, warmup_shapes: [[1, 8]]}\n")
    return root
