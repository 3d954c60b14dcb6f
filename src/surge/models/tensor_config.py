"""Tensor models (kinds onnx, torch, python): their declared contract and Triton's model configuration.

A tensor model is served by tensor name over KServe v2. Its contract is a list
of inputs and outputs with a datatype and dims, plus `max_batch_size`: as in
Triton, when `max_batch_size > 0` the dims leave out the batch dimension
(requests carry `[N, *dims]`, N <= max_batch_size, and the batcher stacks
requests along N); when it is 0 the model runs unbatched on exactly `dims`.
A dim of -1 takes any size.

`TensorModelOptions` is the `tensor:` section of a model.yaml (plain pydantic,
no imports from surge, so config.py can hold it). `TensorModelConfig` is the
resolved contract a service serves; `triton_config()` renders it as Triton's
ModelConfig (JSON form, proto field names), which both `GET /v2/models/{m}/config`
and gRPC `ModelConfig` return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Kind = Literal["hf", "onnx", "torch", "python"]
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES")
# Triton's DataType enum names <-> KServe v2 datatypes (TYPE_STRING is BYTES).
TRITON_TYPE = {d: f"TYPE_{'STRING' if d == 'BYTES' else d}" for d in DATATYPES}
FROM_TRITON_TYPE = {v: k for k, v in TRITON_TYPE.items()}
DEFAULT_FILES = {"onnx": "model.onnx", "torch": "model.pt2", "python": "model.py"}
PLATFORMS = {"onnx": ("onnxruntime_onnx", "onnxruntime"), "torch": ("torch_export", "pytorch"),
             "python": ("", "python")}


def normalize_datatype(value: str) -> str:
    """'FP32', 'fp32' or Triton's 'TYPE_FP32' -> 'FP32'."""
    v = str(value).strip().upper()
    if v in FROM_TRITON_TYPE:
        return FROM_TRITON_TYPE[v]
    if v == "STRING":
        return "BYTES"
    if v not in DATATYPES:
        raise ValueError(f"unknown datatype {value!r} (one of {', '.join(DATATYPES)}, or Triton's TYPE_* names)")
    return v


class TensorDecl(BaseModel):
    """One input or output as a model.yaml declares it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, description="Tensor name (the KServe v2 `name`).")
    datatype: str = Field(..., description="KServe v2 datatype (FP32, INT64, BYTES, ...) or Triton's TYPE_* name.")
    dims: list[int] = Field(..., description="Shape without the batch dimension when max_batch_size > 0; -1: any size.")
    optional: bool = Field(False, description="Inputs only: the request may leave it out.")

    @field_validator("datatype")
    @classmethod
    def _datatype(cls, v: str) -> str:
        return normalize_datatype(v)

    @field_validator("dims")
    @classmethod
    def _dims(cls, v: list[int]) -> list[int]:
        if any(d < -1 or d == 0 for d in v):
            raise ValueError(f"dims {v}: each dim is a positive size or -1")
        return v


MAX_TIMEOUT_S = 1_000_000.0  # about 11.5 days


class TensorModelOptions(BaseModel):
    """The `tensor:` section of a model.yaml (kinds onnx, torch, python)."""

    model_config = ConfigDict(extra="forbid")

    file: str | None = Field(None, description="Model file relative to the version directory "
                             "(default: model.onnx, model.pt2 or model.py by kind).")
    # Upper bounds: a value past them loads, then fails every request (a timeout past what
    # Connection.poll takes, ~2,147,483 s) or GET /v2/models/x/config (Triton's int32 max_batch_size).
    max_batch_size: int | None = Field(None, ge=0, le=2**31 - 1,
                                       description="0: unbatched. Default: onnx/torch take it from the "
                                       "graph (a dynamic first dim is batched up to batching.max_batch_size); "
                                       "python: batching.max_batch_size.")
    inputs: list[TensorDecl] | None = Field(None, description="Inputs (python: required; onnx/torch: read from "
                                            "the graph, a declaration must agree with it).")
    outputs: list[TensorDecl] | None = Field(None, description="Outputs, as inputs.")
    parameters: dict = Field(default_factory=dict, description="Free settings, handed to a python model's initialize.")
    class_name: str = Field("TritonPythonModel", description="python: the class in model.py.")
    timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S, description="python: longest one execute() call may "
                             "take before its worker is killed and restarted (the batch's requests get 504).")
    init_timeout_s: float = Field(120.0, gt=0, le=MAX_TIMEOUT_S,
                                  description="python: longest initialize() may take.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dim when the model batches
    optional: bool = False

    def full_shape(self, batched: bool) -> list[int]:
        return ([-1] if batched else []) + list(self.dims)

    def describe(self, batched: bool) -> str:
        return f"{self.name} ({self.datatype} {self.full_shape(batched)})"


@dataclass
class TensorModelConfig:
    """The resolved contract of one served tensor model."""

    name: str
    kind: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int = 0
    device: str = "cpu"
    instances: int = 1
    max_queue_delay_us: int = 2000
    default_model_filename: str = ""
    parameters: dict = field(default_factory=dict)

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    def metadata(self, versions: list[str]) -> dict:
        """KServe v2 model metadata (shapes include the batch dim as -1)."""
        tensor = lambda t: {"name": t.name, "datatype": t.datatype, "shape": t.full_shape(self.batched)}  # noqa: E731
        return {"name": self.name, "versions": versions, "platform": PLATFORMS[self.kind][0] or self.kind,
                "inputs": [tensor(t) for t in self.inputs], "outputs": [tensor(t) for t in self.outputs]}

    def triton_config(self) -> dict:
        platform, backend = PLATFORMS[self.kind]
        cfg: dict = {"name": self.name, "platform": platform, "backend": backend,
                     "max_batch_size": self.max_batch_size,
                     "input": [{"name": t.name, "data_type": TRITON_TYPE[t.datatype], "dims": list(t.dims),
                                **({"optional": True} if t.optional else {})} for t in self.inputs],
                     "output": [{"name": t.name, "data_type": TRITON_TYPE[t.datatype], "dims": list(t.dims)}
                                for t in self.outputs],
                     "instance_group": [instance_group(self.device, self.instances)],
                     "default_model_filename": self.default_model_filename,
                     "parameters": {k: {"string_value": str(v)} for k, v in self.parameters.items()}}
        if self.batched:
            cfg["dynamic_batching"] = {"max_queue_delay_microseconds": self.max_queue_delay_us}
        return cfg


def instance_group(device: str, count: int) -> dict:
    if device.startswith("cuda"):
        gpu = int(device.split(":")[1]) if ":" in device else 0
        return {"name": "surge", "kind": "KIND_GPU", "count": count, "gpus": [gpu]}
    return {"name": "surge", "kind": "KIND_CPU", "count": count}


def specs_from_decls(decls: list[TensorDecl] | None) -> list[TensorSpec] | None:
    if decls is None:
        return None
    return [TensorSpec(d.name, d.datatype, tuple(d.dims), d.optional) for d in decls]
