"""The KServe v2 (Open Inference Protocol) tensor contract of surge's models.

Both protocol layers (server/http/kserve.py and server/grpc/servicer.py) decode
their wire format into `InputTensor`s and call `decode_request`; they encode
what `encode_embedding` returns. Everything here is plain data in, plain data
out, so that the two protocols cannot drift apart.

The contract of an embedding model (README "KServe v2"):

  inputs   text            BYTES  [N] or [N, 1]   UTF-8 strings
           input_ids       INT64  [N, L]          token ids, special tokens included
                                                  (INT32 is accepted too)
           attention_mask  INT64  [N, L]          optional with input_ids; 1 = real token
  output   embedding       FP32   [N, dim]        FP16 when the request asks for it
  request parameters (all optional): normalize (bool), truncate (bool),
           dimensions (int), datatype ("FP32" or "FP16"; also accepted as a
           parameter of the requested output "embedding")
  output parameter classification = k (Triton's classification extension): the output
           is BYTES [N, k] "<value>:<index>" instead, each row's k highest values
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

from surge import __version__
from surge.errors import InvalidInput, PayloadTooLarge, SurgeError, shown
from surge.server import kserve_classification as classification
from surge.server.http.openai import split_input
from surge.types import EmbedOptions

TEXT, INPUT_IDS, ATTENTION_MASK, EMBEDDING = "text", "input_ids", "attention_mask", "embedding"
ID_DATATYPES = ("INT64", "INT32")
OUTPUT_DATATYPES = ("FP32", "FP16")
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository", "statistics", "parameters"]

# Little-endian, as the specification's binary tensor data extension and
# raw_input_contents require.
NUMPY_DTYPES = {
    "BOOL": np.dtype("?"), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
_USAGE = ("this model takes 'text' (BYTES [N] or [N,1]) or 'input_ids' (INT64 [N,L]) "
          "with an optional 'attention_mask' (INT64 [N,L])")


@dataclass
class InputTensor:
    """One decoded input: `values` is flat (row-major); BYTES values are `bytes`."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: np.ndarray | list[bytes]


@dataclass
class DecodedRequest:
    texts: list[str] | None
    token_ids: list[list[int]] | None
    options: EmbedOptions
    output_datatype: str = "FP32"
    # Per requested output: its name and its parameters (binary_data, ...).
    outputs: list[tuple[str, dict]] = field(default_factory=list)
    # Triton's classification extension: k of the embedding output, when the request asks for it.
    classes: int | None = None


def check_shape(name: str, shape) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise InvalidInput(f"input '{shown(name)}': shape {list(shape)} has a negative dimension")
    return shape


def element_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def numpy_dtype(name: str, datatype: str) -> np.dtype:
    dt = NUMPY_DTYPES.get(datatype)
    if dt is None:
        known = ", ".join(["BYTES", *NUMPY_DTYPES])
        raise InvalidInput(f"input '{shown(name)}': unknown datatype '{shown(datatype)}' (one of {known})")
    return dt


def from_raw(name: str, datatype: str, shape, raw: bytes) -> InputTensor:
    """Decode binary tensor data (HTTP binary extension, gRPC raw_input_contents)."""
    shape = check_shape(name, shape)
    n = element_count(shape)
    if datatype == "BYTES":
        items, off, view = [], 0, memoryview(raw)
        while off < len(raw):
            if off + 4 > len(raw):
                raise InvalidInput(f"input '{shown(name)}': BYTES data ends inside the 4-byte length of element {len(items)}")
            (size,) = struct.unpack_from("<I", raw, off)
            off += 4
            if off + size > len(raw):
                raise InvalidInput(f"input '{shown(name)}': BYTES element {len(items)} declares {size} bytes but only "
                                   f"{len(raw) - off} remain")
            items.append(bytes(view[off:off + size]))
            off += size
        if len(items) != n:
            raise InvalidInput(f"input '{shown(name)}': {len(items)} BYTES elements for shape {list(shape)}, "
                               f"which needs {n}")
        return InputTensor(name, datatype, shape, items)
    dt = numpy_dtype(name, datatype)
    expected = n * dt.itemsize
    if len(raw) != expected:
        raise InvalidInput(f"input '{shown(name)}': {len(raw)} bytes of data, but shape {list(shape)} of {shown(datatype)} "
                           f"needs {expected}")
    return InputTensor(name, datatype, shape, np.frombuffer(raw, dtype=dt))


def from_values(name: str, datatype: str, shape, data) -> InputTensor:
    """Decode JSON `data` (flat or nested lists) or gRPC typed `contents`."""
    shape = check_shape(name, shape)
    n = element_count(shape)
    flat = _flatten(data)
    if len(flat) != n:
        raise InvalidInput(f"input '{shown(name)}': {len(flat)} elements for shape {list(shape)}, which needs {n}")
    if datatype == "BYTES":
        items = []
        for i, x in enumerate(flat):
            if isinstance(x, str):
                items.append(x.encode("utf-8"))
            elif isinstance(x, (bytes, bytearray)):
                items.append(bytes(x))
            else:
                raise InvalidInput(f"input '{shown(name)}': element {i} is {type(x).__name__}, but BYTES needs strings")
        return InputTensor(name, datatype, shape, items)
    dt = numpy_dtype(name, datatype)
    for i, x in enumerate(flat):
        ok = isinstance(x, bool) if dt.kind == "b" else (
            isinstance(x, int) and not isinstance(x, bool) if dt.kind in "iu" else
            isinstance(x, (int, float)) and not isinstance(x, bool))
        if not ok:
            raise InvalidInput(f"input '{shown(name)}': element {i} ({shown(repr(x))}) is not a valid {shown(datatype)} value")
    try:
        return InputTensor(name, datatype, shape, np.asarray(flat, dtype=dt))
    except OverflowError:
        raise InvalidInput(f"input '{shown(name)}': a value does not fit in {shown(datatype)}") from None


def _flatten(data) -> list:
    if not isinstance(data, (list, tuple)):
        if hasattr(data, "__len__") and not isinstance(data, (str, bytes, bytearray, dict)):
            return list(data)  # protobuf repeated fields
        raise InvalidInput("tensor 'data' must be a list")
    if not any(isinstance(x, (list, tuple)) for x in data):
        return list(data)
    out, stack = [], [iter(data)]
    while stack:  # iterative: a deeply nested body cannot blow the stack
        for x in stack[-1]:
            if isinstance(x, (list, tuple)):
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out


def decode_request(tensors: list[InputTensor], params: dict, outputs: list[tuple[str, dict]],
                   max_inputs: int, max_chars: int) -> DecodedRequest:
    """Turn decoded inputs, request parameters and requested outputs into an embed call."""
    by_name: dict[str, InputTensor] = {}
    for t in tensors:
        if t.name in by_name:
            raise InvalidInput(f"input '{shown(t.name)}' is given twice")
        by_name[t.name] = t
    unknown = sorted(set(by_name) - {TEXT, INPUT_IDS, ATTENTION_MASK})
    if unknown:
        raise InvalidInput(f"unexpected input '{shown(unknown[0])}': {_USAGE}")
    if TEXT in by_name and INPUT_IDS in by_name:
        raise InvalidInput(f"send either 'text' or 'input_ids', not both: {_USAGE}")
    if TEXT in by_name:
        if ATTENTION_MASK in by_name:
            raise InvalidInput("'attention_mask' goes with 'input_ids', not with 'text'")
        texts, ids = _texts(by_name[TEXT], max_inputs, max_chars), None
    elif INPUT_IDS in by_name:
        texts, ids = None, _token_ids(by_name[INPUT_IDS], by_name.get(ATTENTION_MASK), max_inputs)
    else:
        raise InvalidInput(f"missing input: {_USAGE}")
    datatype = _param(params, "datatype", str, "FP32")
    for name, out_params in outputs:
        if name != EMBEDDING:
            raise InvalidInput(f"unknown output '{shown(name)}': this model has one output, '{EMBEDDING}'")
        datatype = _param(out_params, "datatype", str, datatype)
    if datatype not in OUTPUT_DATATYPES:
        raise InvalidInput(f"output datatype '{shown(datatype)}' is not supported (FP32 or FP16)")
    classes = classification.counts(outputs).get(EMBEDDING)  # checked before the model runs
    options = EmbedOptions(normalize=_param(params, "normalize", bool, None),
                           truncate=_param(params, "truncate", bool, True),
                           dimensions=_param(params, "dimensions", int, None))
    return DecodedRequest(texts, ids, options, datatype, outputs, classes)


def _param(params: dict, key: str, kind: type, default):
    if key not in params:
        return default
    value = params[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidInput(f"parameter '{shown(key)}' must be {kind.__name__}, got {shown(repr(value))}")
    return value


def _texts(t: InputTensor, max_inputs: int, max_chars: int) -> list[str]:
    if t.datatype != "BYTES":
        raise InvalidInput(f"input 'text' must have datatype BYTES, got {t.datatype}")
    if not (len(t.shape) == 1 or (len(t.shape) == 2 and t.shape[1] == 1)):
        raise InvalidInput(f"input 'text' must have shape [N] or [N,1], got {list(t.shape)}")
    texts = []
    for i, raw in enumerate(t.values):
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidInput(f"input 'text' element {i} is not valid UTF-8") from None
    try:
        return split_input(texts, max_inputs, max_chars)[0]
    except SurgeError as exc:
        raise _renamed(exc, TEXT, "element") from None


def _token_ids(t: InputTensor, mask: InputTensor | None, max_inputs: int) -> list[list[int]]:
    if t.datatype not in ID_DATATYPES:
        raise InvalidInput(f"input 'input_ids' must have datatype INT64, got {t.datatype}")
    if len(t.shape) != 2:
        raise InvalidInput(f"input 'input_ids' must have shape [N,L], got {list(t.shape)}")
    if t.shape[0] > max_inputs:
        # Before any per-row work: a shape [10**9, 0] has no elements (a ~100-byte request), and one
        # Python list per row took the server out of memory before split_input counted them.
        raise PayloadTooLarge(f"'{INPUT_IDS}' has {t.shape[0]} rows; at most {max_inputs} are allowed",
                              param=INPUT_IDS)
    rows = np.asarray(t.values, dtype=np.int64).reshape(t.shape)
    if mask is not None:
        if mask.datatype not in ID_DATATYPES:
            raise InvalidInput(f"input 'attention_mask' must have datatype INT64, got {mask.datatype}")
        if tuple(mask.shape) != tuple(t.shape):
            raise InvalidInput(f"input 'attention_mask' has shape {list(mask.shape)}, but 'input_ids' has "
                               f"{list(t.shape)}")
        m = np.asarray(mask.values, dtype=np.int64).reshape(mask.shape)
        if m.size and not np.isin(m, (0, 1)).all():
            raise InvalidInput("input 'attention_mask' must hold only 0 and 1")
        seqs = [row[keep.astype(bool)].tolist() for row, keep in zip(rows, m)]
    else:
        seqs = [row.tolist() for row in rows]
    try:
        return split_input(seqs, max_inputs, 1 << 30)[1]
    except SurgeError as exc:
        raise _renamed(exc, INPUT_IDS, "row") from None


def _renamed(exc: SurgeError, tensor: str, unit: str) -> SurgeError:
    """split_input's message about 'input' (the OpenAI field), told about the tensor instead."""
    message = exc.message.replace("'input'", f"'{tensor}'").replace("input ", f"'{tensor}' {unit} ")
    return type(exc)(message, param=tensor)


def encode_embedding(vectors: np.ndarray, datatype: str) -> np.ndarray:
    """The 'embedding' output, C-contiguous in the requested datatype."""
    return np.ascontiguousarray(vectors, dtype=NUMPY_DTYPES[datatype])


def embedding_output(vectors: np.ndarray, decoded: DecodedRequest) -> tuple[str, np.ndarray]:
    """(datatype, array) of the 'embedding' output as the request asked for it: the vectors in its datatype,
    or, with the classification extension, BYTES [N, k] of each row's k highest values (as Triton applies it
    to any numeric output; an embedding has no labels). Both protocols answer with this."""
    array = encode_embedding(vectors, decoded.output_datatype)
    if decoded.classes is None:
        return decoded.output_datatype, array
    return "BYTES", classification.top_k(EMBEDDING, array, decoded.classes, None, batched=True)


def check_load_parameters(params: dict) -> str | None:
    """The version a repository load/unload names, if any. A model config or
    files sent along (Triton's "config", "file:<path>") cannot be honoured, so
    they are refused rather than silently ignored."""
    for key in params:
        if key == "config" or key.startswith("file:"):
            raise InvalidInput(f"parameter '{shown(key)}' is not supported: surge loads models from their own directory "
                               "(model.yaml), not from a config sent with the request")
    version = params.get("version")
    return None if version is None else str(version)


INDEX_FIELDS = ("name", "version", "state", "reason")


def repository_index(models: list[dict], ready_only: bool) -> list[dict]:
    """The KServe repository index: its four fields of each entry (the native
    listing adds `serving` and `inflight`, which the index messages do not have)."""
    return [{k: str(m.get(k, "")) for k in INDEX_FIELDS} for m in models
            if not ready_only or m.get("state") == "READY"]


def server_metadata() -> dict:
    return {"name": "surge", "version": __version__, "extensions": list(EXTENSIONS)}


def platform(service) -> str:
    """Triton's platform of an encoder model: the device's kind, not its index (the metadata and the config
    name it alike; a replica on cuda:1 is the same platform as one on cuda:0)."""
    return f"surge_{service.worker.engines.capabilities.device.split(':')[0]}"


def model_metadata(service, versions: list[str]) -> dict:
    if getattr(service, "task", "embed") == "tensor":  # onnx, torch, python: their own tensors
        return service.config.metadata(versions)
    own = getattr(service, "kserve_metadata", None)  # a model of another task describes itself
    if own is not None:
        return own(versions)
    if getattr(service, "task", "embed") in ("classify", "rerank", "token-classify"):  # classify / rerank / token-classify: their own contract
        from surge.server import kserve_tasks

        return kserve_tasks.metadata(service, versions)
    ids = {"datatype": "INT64", "shape": [-1, -1]}
    return {
        "name": service.name,
        "versions": versions,
        "platform": platform(service),
        "inputs": [{"name": TEXT, "datatype": "BYTES", "shape": [-1]},
                   {"name": INPUT_IDS, **ids}, {"name": ATTENTION_MASK, **ids}],
        "outputs": [{"name": EMBEDDING, "datatype": "FP32", "shape": [-1, int(service.dimensions)]}],
    }
