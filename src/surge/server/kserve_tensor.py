"""KServe v2 inference by tensor name (tensor models: kinds onnx, torch, python),
and Triton's model configuration for every served model.

server/http/kserve.py and server/grpc/servicer.py decode their wire format into
`InputTensor`s (server/kserve_contract.py, which also checks byte sizes), then
hand a tensor model's request here; the model's contract check (names,
datatypes, shapes) is the service's own (runtime/tensor_service.py).
"""

from __future__ import annotations

import struct

import numpy as np

from surge.errors import InvalidInput
from surge.models.tensor_config import TRITON_TYPE, instance_group
from surge.server import kserve_contract as contract


def is_tensor_model(service) -> bool:
    return getattr(service, "task", "embed") == "tensor"


def to_arrays(tensors: list[contract.InputTensor]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for t in tensors:
        if t.name in out:
            raise InvalidInput(f"input '{t.name}' is given twice", param=t.name)
        if t.datatype == "BYTES":
            out[t.name] = np.array(list(t.values), dtype=object).reshape(t.shape) if t.values else \
                np.empty(t.shape, dtype=object)
        else:
            out[t.name] = np.asarray(t.values).reshape(t.shape)
    return out


def datatype_of(array: np.ndarray) -> str:
    from surge.runtime.tensor_service import datatype_of as dt

    return dt(array)


def raw_bytes(array: np.ndarray) -> bytes:
    """The binary tensor data of one output (BYTES: each element after its 4-byte little-endian length)."""
    if array.dtype == object:
        return b"".join(struct.pack("<I", len(v)) + v for v in array.ravel())
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def json_data(array: np.ndarray) -> list:
    if array.dtype == object:
        return [v.decode("utf-8", errors="replace") for v in array.ravel()]
    if array.dtype == np.float16:
        return array.astype(np.float32).ravel().tolist()
    return array.ravel().tolist()


# Request parameters the server itself acts on (the binary extension's, and those Triton reserves); the
# others are the model's: a python model reads them with request.parameters(), as in Triton.
SERVER_PARAMETERS = frozenset({"binary_data_output", "priority", "timeout", "sequence_id", "sequence_start",
                               "sequence_end", "headers"})


def model_parameters(parameters: dict | None) -> dict:
    return {k: v for k, v in (parameters or {}).items() if k not in SERVER_PARAMETERS}


async def run(state, service, inputs: dict[str, np.ndarray], outputs: list[str] | None,
              parameters: dict | None = None):
    """service.infer through AppState.call: one deadline (504 past it) and the KServe statistics."""
    params = model_parameters(parameters)
    return await state.call(service, lambda deadline: service.infer(inputs, outputs, parameters=params)
                            if deadline is None else service.infer(inputs, outputs, deadline=deadline,
                                                                   parameters=params))


async def infer(state, service, tensors: list[contract.InputTensor], outputs: list[tuple[str, dict]],
                parameters: dict | None = None):
    """(result, [(name, array)]) of a tensor model's request, with Triton's classification extension applied
    to the outputs that ask for it (no labels: a tensor model declares none; a batching model's rows are its
    items, as Triton's max_batch_size > 0)."""
    from surge.server import kserve_classification as classification

    wanted = classification.counts(outputs)  # checked before the model runs
    result = await run(state, service, to_arrays(tensors), check_outputs(outputs), parameters)
    arrays = [(n, "", a) for n, a in result.outputs.items()]
    arrays = classification.apply(arrays, wanted, None, batched=bool(service.config.batched))
    return result, [(n, a) for n, _, a in arrays]


def check_outputs(outputs: list[tuple[str, dict]]) -> list[str] | None:
    names = [n for n, _ in outputs]
    if len(set(names)) != len(names):
        raise InvalidInput("an output is requested twice")
    return names or None


# ---- Triton model configuration ----------------------------------------------------
def model_config(service) -> dict:
    """Triton's ModelConfig (JSON form: proto field names, enum names) for any served model."""
    if is_tensor_model(service):
        return service.config.triton_config()
    if getattr(service, "task", "embed") == "generate":  # a decoder model describes itself
        return service.triton_config()
    # An embedding model: its tensor contract (README "KServe v2") in Triton's terms.
    batching = getattr(service, "batching", None)
    caps = service.worker.engines.capabilities
    max_batch = min(batching.max_batch_size, caps.max_batch) if batching is not None and batching.enabled else 0
    ids = {"data_type": "TYPE_INT64", "dims": [-1], "optional": True}
    cfg = {
        "name": service.name, "platform": contract.platform(service), "backend": "surge",
        "max_batch_size": max_batch,
        "input": [{"name": contract.TEXT, "data_type": TRITON_TYPE["BYTES"], "dims": [1], "reshape": {"shape": []},
                   "optional": True},
                  {"name": contract.INPUT_IDS, **ids}, {"name": contract.ATTENTION_MASK, **ids}],
        "output": [{"name": contract.EMBEDDING, "data_type": "TYPE_FP32", "dims": [int(service.dimensions)]}],
        "instance_group": [instance_group(caps.device, len(service.worker.engines.engines))],
        "parameters": {"task": {"string_value": getattr(service, "task", "embed")},
                       "kind": {"string_value": getattr(service, "kind", "hf")}},
    }
    if getattr(service, "task", "embed") in ("classify", "rerank", "token-classify"):
        # a task model's own tensors (server/kserve_tasks.py), as its metadata describes them
        meta = contract.model_metadata(service, [])
        cfg["input"] = [_config_tensor(t, max_batch > 0) for t in meta["inputs"]]
        cfg["output"] = [_config_tensor(t, max_batch > 0) for t in meta["outputs"]]
    if max_batch:
        cfg["dynamic_batching"] = {"max_queue_delay_microseconds": int(batching.max_queue_delay_ms * 1000)}
    return cfg


def _config_tensor(t: dict, batched: bool) -> dict:
    """A metadata tensor as a config's: Triton's type name; under max_batch_size > 0 its dims leave out the
    batch dimension, and a tensor of one value per item is [1] reshaped to [] (as the embedding's text)."""
    dims = [int(d) for d in (t["shape"][1:] if batched else t["shape"])]
    out = {"name": t["name"], "data_type": TRITON_TYPE[t["datatype"]], "dims": dims or [1]}
    if not dims:
        out["reshape"] = {"shape": []}
    return out


def model_config_proto(service):
    from google.protobuf import json_format

    from surge.server.grpc import grpc_service_pb2 as pb

    return json_format.ParseDict(model_config(service), pb.ModelConfig())
