"""Triton's classification extension: an output requested with the parameter `classification` = k (HTTP:
the output's "parameters"; gRPC: its parameters map, as tritonclient's `InferRequestedOutput(name,
class_count=k)` sends it) comes back as BYTES strings "<value>:<index>[:<label>]", the k highest values
best first, in place of the tensor.

As Triton (src/classification.cc): a model that batches gets one row of k a batch item ([N, k], each item's
values taken flat), one that does not gets [k] over the whole tensor; k above the number of values gives
them all; the value is printed as C++'s std::to_string prints it (six decimals for a float, an integer as
is). Labels: a task model's own (its config's id2label); a tensor model has none, so it answers
"<value>:<index>". Triton's std::sort leaves ties in no set order; here the lower index comes first, so an
answer does not change from call to call.
"""

from __future__ import annotations

import numpy as np

from surge.errors import InvalidInput, shown

PARAM = "classification"


def counts(outputs: list[tuple[str, dict]]) -> dict[str, int]:
    """{output name: k} of the requested outputs that ask for classification."""
    out = {}
    for name, params in outputs:
        if PARAM not in params:
            continue
        k = params[PARAM]
        # a JSON string or fraction is refused by name rather than read loosely (Triton takes an integer)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidInput(f"output '{shown(name)}': parameter '{PARAM}' must be a positive integer (the "
                               f"number of classes), got {shown(repr(k))}", param=PARAM)
        out[name] = k
    return out


def _text(value, is_float: bool) -> str:
    return f"{float(value):f}" if is_float else str(int(value))


def top_k(name: str, array: np.ndarray, k: int, labels: list[str] | None, batched: bool) -> np.ndarray:
    """The classification strings of one output array (BYTES elements: bytes)."""
    if array.dtype == object or array.dtype.kind not in "iuf":
        raise InvalidInput(f"class result not available for output '{shown(name)}' due to unsupported type "
                           f"of its values ({array.dtype})", param=PARAM)
    rows = array.reshape(array.shape[0], -1) if batched and array.ndim else array.reshape(1, -1)
    count = min(k, rows.shape[1])
    is_float = array.dtype.kind == "f"
    # descending by value, ties by ascending index; float64 holds every value of the smaller types exactly
    # (and the order of int64 values apart from ties beyond 2**53, which no logit reaches)
    keys = rows.astype(np.float64)
    out = np.empty((rows.shape[0], count), dtype=object)
    for r, row in enumerate(keys):
        order = np.lexsort((np.arange(row.size), -row))[:count]
        for j, i in enumerate(order):
            s = f"{_text(rows[r, i], is_float)}:{int(i)}"
            if labels is not None and i < len(labels):
                s += f":{labels[i]}"
            out[r, j] = s.encode()
    return out if batched and array.ndim else out[0]


def apply(outputs: list[tuple[str, str, np.ndarray]], wanted: dict[str, int], labels: list[str] | None,
          batched: bool) -> list[tuple[str, str, np.ndarray]]:
    """(name, datatype, array) outputs with those in `wanted` replaced by their classification."""
    if not wanted:
        return outputs
    return [(n, "BYTES", top_k(n, a, wanted[n], labels, batched)) if n in wanted else (n, d, a)
            for n, d, a in outputs]
