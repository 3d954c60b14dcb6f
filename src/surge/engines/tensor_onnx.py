"""A generic tensor engine on ONNX Runtime: any .onnx graph, fed and read by tensor name.

Inputs and outputs (names, datatypes, shapes; a symbolic or unknown dim is -1)
come from the graph. CPU always; CUDA through ONNX Runtime's CUDA execution
provider, which only the `onnxruntime-gpu` build has: asking for cuda without
it is a clear error, never a silent fall back to the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from surge.engines.int8_weights import prepared
from surge.errors import ConfigError, EngineError, InvalidInput

# ONNX Runtime's type strings -> KServe v2 datatypes.
ORT_DATATYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def _dims(shape) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d > 0 else -1 for d in shape)


class OnnxTensorEngine:
    """load(path) -> inputs/outputs as (name, datatype, full shape); run(feeds) -> outputs by name."""

    def __init__(self, device: str = "cpu", threads: int = 0):
        self.device = device
        self.threads = threads
        self.session = None
        self.inputs: list[tuple[str, str, tuple[int, ...]]] = []
        self.outputs: list[tuple[str, str, tuple[int, ...]]] = []

    def providers(self) -> list:
        import onnxruntime as ort

        if self.device == "cpu":
            return ["CPUExecutionProvider"]
        if not self.device.startswith("cuda"):
            raise ConfigError(f"device '{self.device}' is not cpu or cuda[:N]", param="engine.device")
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ConfigError(
                f"device '{self.device}' needs ONNX Runtime's CUDA provider, which this onnxruntime build lacks "
                f"(providers: {', '.join(ort.get_available_providers())}); install the GPU build: "
                "pip install 'surge[onnx-gpu]' (onnxruntime-gpu), or serve on device cpu", param="engine.device")
        index = int(self.device.split(":")[1]) if ":" in self.device else 0
        return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]

    def load(self, path: Path) -> None:
        import onnxruntime as ort

        providers = self.providers()
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads:
            opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        try:
            # a user's INT8 graph too: exact products on CPUs whose u8 x s8 kernel saturates
            model = prepared(path) if self.device == "cpu" else str(path)
            self.session = ort.InferenceSession(model, opts, providers=providers)
        except Exception as exc:  # a file that is not an ONNX model, or one ORT cannot run
            raise EngineError(f"cannot load {Path(path).name}: {str(exc).strip().splitlines()[-1][:300]}") from None
        for kind, items in (("input", self.session.get_inputs()), ("output", self.session.get_outputs())):
            out = self.inputs if kind == "input" else self.outputs
            for a in items:
                dt = ORT_DATATYPES.get(a.type)
                if dt is None:
                    raise EngineError(f"{kind} '{a.name}' has type {a.type}, which KServe v2 cannot carry")
                out.append((a.name, dt, _dims(a.shape)))

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        names = outputs or [o[0] for o in self.outputs]
        feeds = {k: (v.astype(str) if v.dtype == object else v) for k, v in feeds.items()}
        try:
            got = self.session.run(names, feeds)
        except Exception as exc:
            # ORT's InvalidArgument is a request the graph rejects (a shape its
            # ops cannot take): the client's error. Anything else is the engine's.
            msg = str(exc).strip().splitlines()[-1][:300] if str(exc) else type(exc).__name__
            if type(exc).__name__ == "InvalidArgument":
                raise InvalidInput(f"the model rejected the inputs: {msg}") from None
            raise EngineError(f"inference failed: {msg}") from None
        out = {}
        for n, v in zip(names, got):
            v = np.asarray(v)
            if v.dtype.kind in "UO":  # ORT returns strings as str: BYTES travel as bytes
                v = np.array([s.encode() for s in v.ravel()], dtype=object).reshape(v.shape)
            out[n] = v
        return out

    def close(self) -> None:
        self.session = None
