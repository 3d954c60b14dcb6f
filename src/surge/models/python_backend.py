"""What a `kind: python` model's model.py uses (the counterpart of Triton's
triton_python_backend_utils, kept small).

    import numpy as np
    from surge.models.python_backend import InferenceResponse, ModelError, client

    class TritonPythonModel:
        def initialize(self, args):          # args: model_config (dict), model_name, model_version,
            self.scale = float(args["parameters"].get("scale", 2))   # model_repository, parameters
        def execute(self, requests):          # one call per batch of requests
            out = []
            for r in requests:
                x = r.input("x")              # numpy array, [N, ...] when the model batches
                opts = json.loads(r.parameters())   # the request's KServe `parameters`, as in Triton
                names = r.requested_output_names()  # the outputs asked for (all without a choice)
                if not np.isfinite(x).all():
                    out.append(ModelError("x must be finite"))       # fails this request only (400)
                    continue
                vec = client.infer("encoder", {"x": x})["y"]        # another served model
                out.append({"y": vec * self.scale})                  # or InferenceResponse({...})
            return out                        # exactly one response per request, in order
        def finalize(self): ...

The model runs in its own process (surge.models.python_child); `client` talks
to the server that started it, so calls go through the other model's batcher
and cache.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field

import numpy as np

_STATUS = {400, 404, 429, 500, 503, 504}


class ModelError(Exception):
    """An error for one request (return it as that request's response, or raise it
    from execute to fail the whole batch). `status`: the HTTP status it gets."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status if status in _STATUS else 500


@dataclass
class InferenceRequest:
    inputs: dict[str, np.ndarray]
    requested_outputs: list[str] = field(default_factory=list)
    request_parameters: dict = field(default_factory=dict)

    def input(self, name: str) -> np.ndarray | None:
        return self.inputs.get(name)

    # Triton-style spelling
    get_input_tensor_by_name = input

    def requested_output_names(self) -> list[str]:
        """The outputs the client asked for (KServe `outputs`, tritonclient's InferRequestedOutput), in its
        order; every output of the model's config when it named none, as Triton's core fills them in before
        the python backend sees the request. A model may compute only these: the response needs no other."""
        return list(self.requested_outputs)

    def parameters(self) -> str:
        """The request's KServe v2 `parameters` object as a JSON string, as Triton's python backend gives it
        (`json.loads(request.parameters())`); "{}" without any. Parameters the server itself consumes
        (binary_data_output, priority, timeout, sequence_*) are not in it."""
        return json.dumps(self.request_parameters)


@dataclass
class InferenceResponse:
    outputs: dict = field(default_factory=dict)
    error: ModelError | str | None = None


class Client:
    """Calls other served models from inside model.py (set up by the worker)."""

    def __init__(self):
        self._conn = None
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def _call(self, op: str, model: str, payload, version: str | None):
        if self._conn is None:
            raise RuntimeError("surge's client only works inside a served python model")
        with self._lock:
            call_id = next(self._ids)
            self._conn.send(("call", call_id, op, model, version, payload))
            msg = self._conn.recv()
        _, got_id, ok, value = msg
        if got_id != call_id:
            raise RuntimeError("surge client: reply out of order")
        if not ok:
            message, status = value
            raise ModelError(message, status)
        return value

    def infer(self, model: str, inputs: dict, outputs: list[str] | None = None,
              version: str | None = None, parameters: dict | None = None) -> dict[str, np.ndarray]:
        """A tensor model's outputs for `inputs` (name -> array). `parameters`: the call's request
        parameters (a python model reads them with request.parameters(); Triton's
        InferenceRequest(parameters=...)): str keys, JSON values."""
        arrays = {k: np.asarray(v) for k, v in inputs.items()}
        params = dict(parameters or {})
        if any(not isinstance(k, str) for k in params):
            raise TypeError("parameters: keys must be str")
        json.dumps(params)  # a value the callee could not read fails here, in the caller's line
        return self._call("infer", model, (arrays, outputs, params), version)

    def embed(self, model: str, texts: list[str], version: str | None = None) -> np.ndarray:
        """An embedding model's vectors for `texts` (float32 [N, dim])."""
        return self._call("embed", model, list(texts), version)


client = Client()
