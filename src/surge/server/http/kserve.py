"""KServe v2 / Open Inference Protocol over HTTP/REST.

Health, server and model metadata, readiness, inference with JSON tensors and
the binary tensor data extension, the model repository extension and
statistics. Decoding and the model's tensor contract are shared with gRPC
(server/kserve_contract.py); errors are SurgeErrors, rendered as
{"error": "..."} by server/errors.py for every /v2 path.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from surge.errors import InvalidInput, NotFound, shown
from surge.server import kserve_contract as contract
from surge.server import kserve_tensor
from surge.server.http import fail_fast
from surge.runtime.off_loop import prepared
from surge.server.http.common import ORJSONResponse, checked_json, decode_json, read_body
from surge.server.http.generate_common import until_disconnect
from surge.server.http.openapi import BINARY, JSON, body
from surge.server.state import AppState
from surge.runtime.request import response_headers

HEADER_LENGTH = "inference-header-content-length"


class _Tensor(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    datatype: StrictStr
    shape: list[StrictInt]
    parameters: dict[str, Any] = {}
    data: Any = None


class _Output(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    parameters: dict[str, Any] = {}


class _InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = None
    parameters: dict[str, Any] = {}
    inputs: list[_Tensor]
    outputs: list[_Output] | None = None


class _RepositoryRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    ready: StrictBool = False
    parameters: dict[str, Any] = {}


def _validate(model, data):
    """Schema check; the specification has one status (400) for any malformed request."""
    if not isinstance(data, dict):
        raise InvalidInput("request body must be a JSON object")
    try:
        fail_fast.check(model, data)  # a large body: its first error found without collecting them all
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        what = "missing" if first.get("type") == "missing" else f"invalid: {first.get('msg')}"
        raise InvalidInput(f"field '{shown(where)}' is {what}", param=shown(where)) from None


def binary_flag(params: dict, key: str, default: bool) -> bool:
    """binary_data_output (a request's) or binary_data (an output's): a JSON boolean; a string such as "false"
    is refused rather than read as Python's truth ("false" is true)."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput(f"parameter '{key}' must be a boolean (true or false), got {shown(repr(value))}",
                           param=key)
    return value


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary tensor data that follows it (binary extension)."""
    if header_length is None:
        return body, b""
    try:
        n = int(header_length)
    except ValueError:
        raise InvalidInput(f"Inference-Header-Content-Length '{header_length}' is not an integer") from None
    if not 0 < n <= len(body):
        raise InvalidInput(f"Inference-Header-Content-Length {n} does not fit a body of {len(body)} bytes")
    return body[:n], body[n:]


def decode_inputs(inputs: list[_Tensor], binary: bytes) -> list[contract.InputTensor]:
    tensors, offset = [], 0
    for t in inputs:
        size = t.parameters.get("binary_data_size")
        if size is not None:
            if t.data is not None:
                raise InvalidInput(f"input '{shown(t.name)}' has both 'data' and 'binary_data_size'")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidInput(f"input '{shown(t.name)}': binary_data_size must be a non-negative integer")
            if offset + size > len(binary):
                raise InvalidInput(f"input '{shown(t.name)}': binary_data_size {size} runs past the end of the binary "
                                   f"data ({len(binary) - offset} bytes left)")
            tensors.append(contract.from_raw(t.name, t.datatype, t.shape, binary[offset:offset + size]))
            offset += size
        elif t.data is None:
            raise InvalidInput(f"input '{shown(t.name)}' has neither 'data' nor a 'binary_data_size' parameter")
        else:
            tensors.append(contract.from_values(t.name, t.datatype, t.shape, t.data))
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    return tensors


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits
    registry = state.registry

    def lifecycle():
        if state.lifecycle is None:
            raise NotFound("this server has no model repository")
        return state.lifecycle

    @r.get("/v2/health/live")
    async def live():
        return ORJSONResponse({"live": True})

    not_ready = {"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"}}}

    @r.get("/v2/health/ready", responses={400: {"description": "Not ready", "content": {JSON: {"schema": not_ready}}}})
    async def ready():
        # Ready once startup is done and every loaded model is warm; a model
        # unloaded on purpose does not make the server unready (as Triton).
        ok = state.started and all(s.ready for s in registry.services())
        return ORJSONResponse({"ready": ok}, status_code=200 if ok else 400)

    @r.get("/v2")
    async def server_metadata():
        return ORJSONResponse(contract.server_metadata())

    async def stats(name: str | None = None, version: str | None = None):
        if name is None:
            services = registry.services()
        elif version is None:
            registry.get(name)  # 404 for an unknown model
            services = [registry.get(name, v) for v in registry.versions(name)]
        else:
            services = [registry.get(name, version)]
        return ORJSONResponse(
            {"model_stats": [state.stats.snapshot(s.name, s.version) for s in services]})

    r.get("/v2/models/stats")(stats)
    r.get("/v2/models/{name}/stats")(stats)
    r.get("/v2/models/{name}/versions/{version}/stats")(stats)

    async def model_metadata(name: str, version: str | None = None):
        service = registry.get(name, version)
        versions = [version] if version else registry.versions(name)
        return ORJSONResponse(contract.model_metadata(service, versions))

    r.get("/v2/models/{name}")(model_metadata)
    r.get("/v2/models/{name}/versions/{version}")(model_metadata)

    async def model_config(name: str, version: str | None = None):
        return ORJSONResponse(kserve_tensor.model_config(registry.get(name, version)))

    r.get("/v2/models/{name}/config")(model_config)
    r.get("/v2/models/{name}/versions/{version}/config")(model_config)

    async def model_ready(name: str, version: str | None = None):
        service = registry.get(name, version)
        if not service.ready:
            raise InvalidInput(f"model '{shown(name)}' is not ready")  # the specification: 4xx means false
        return ORJSONResponse({"name": service.name, "ready": True})

    r.get("/v2/models/{name}/ready")(model_ready)
    r.get("/v2/models/{name}/versions/{version}/ready")(model_ready)

    async def infer(request: Request, name: str, version: str | None = None):
        service = registry.get(name, version)
        body = await read_body(request, limits.max_body_bytes)
        header, binary = split_body(body, request.headers.get(HEADER_LENGTH))
        # a large header is decoded and checked on a preparation thread (runtime/off_loop.py)
        req = await prepared(len(header), checked_json, functools.partial(_validate, _InferRequest), header)
        outputs = [(o.name, o.parameters) for o in req.outputs or []]
        if kserve_tensor.is_tensor_model(service):
            return await tensor_infer(service, req, binary, outputs, len(body))
        if getattr(service, "task", "embed") in ("classify", "rerank", "token-classify"):  # task models: server/kserve_tasks.py's contract
            return await _task_infer(service, req, binary, outputs, len(body))
        if getattr(service, "task", "embed") == "generate":  # server/kserve_generate_infer.py's contract
            return await generate_infer(request, name, version, req, binary, outputs, len(body))
        # the tensors' values checked and converted one by one (~0.25 us each, 819,200 ids: ~200 ms): a large
        # body's on a preparation thread, as its JSON
        decoded = await prepared(len(body), lambda: contract.decode_request(
            decode_inputs(req.inputs, binary), req.parameters, outputs, limits.max_inputs_per_request,
            limits.max_input_chars))
        result = await state.run(service, texts=decoded.texts, token_ids=decoded.token_ids,
                                 options=decoded.options)
        datatype, array = contract.embedding_output(result.vectors, decoded)
        wants_binary = binary_flag(req.parameters, "binary_data_output", False)
        for out_name, params in outputs:
            if out_name == contract.EMBEDDING and "binary_data" in params:
                wants_binary = binary_flag(params, "binary_data", False)
        out = {"name": contract.EMBEDDING, "datatype": datatype, "shape": list(array.shape)}
        body = {"model_name": result.model, "model_version": result.version,
                "parameters": {"prompt_tokens": int(result.prompt_tokens)}, "outputs": [out]}
        if req.id is not None:
            body["id"] = req.id
        headers = response_headers(result)
        if not wants_binary:
            # orjson has no float16: FP16 values go out as the float32 numbers they are exactly.
            out["data"] = kserve_tensor.json_data(array) if array.dtype == object else \
                (array.astype(np.float32) if array.dtype == np.float16 else array).ravel()
            return ORJSONResponse(body, headers=headers)
        raw = kserve_tensor.raw_bytes(array)  # BYTES too (a classification output)
        out["parameters"] = {"binary_data_size": len(raw)}
        head = orjson.dumps(body)
        headers["Inference-Header-Content-Length"] = str(len(head))
        return Response(head + raw, media_type="application/octet-stream", headers=headers)

    async def _task_infer(service, req, binary: bytes, outputs, size: int):
        from surge.server import kserve_tasks

        inputs = await prepared(size, decode_inputs, req.inputs, binary)  # as the embeddings' (infer)
        result, arrays = await kserve_tasks.infer(state, service, inputs, req.parameters, outputs, limits)
        wanted = {n for n, _ in outputs}
        arrays = [a for a in arrays if not wanted or a[0] in wanted]
        default_binary = binary_flag(req.parameters, "binary_data_output", False)
        binary_of = {n: binary_flag(p, "binary_data", default_binary) for n, p in outputs}
        body = {"model_name": result.model, "model_version": result.version,
                "parameters": {"prompt_tokens": int(result.prompt_tokens)}, "outputs": []}
        if req.id is not None:
            body["id"] = req.id
        raw = b""
        for name, dtype, array in arrays:
            out = {"name": name, "datatype": dtype, "shape": list(array.shape)}
            if binary_of.get(name, default_binary):
                data = kserve_tensor.raw_bytes(array)  # BYTES too (a classification output)
                out["parameters"] = {"binary_data_size": len(data)}
                raw += data
            else:
                out["data"] = kserve_tensor.json_data(array) if array.dtype == object else array.ravel()
            body["outputs"].append(out)
        headers = {"x-surge-model-version": result.version}
        if not raw:
            return ORJSONResponse(body, headers=headers)
        head = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        headers["Inference-Header-Content-Length"] = str(len(head))
        return Response(head + raw, media_type="application/octet-stream", headers=headers)


    async def tensor_infer(service, req: _InferRequest, binary: bytes, outputs: list[tuple[str, dict]], size: int):
        inputs = await prepared(size, decode_inputs, req.inputs, binary)  # as the embeddings' (infer)
        result, arrays = await kserve_tensor.infer(state, service, inputs, outputs, req.parameters)
        return _tensors(result.model, result.version, req, arrays, outputs)

    async def generate_infer(request: Request, name: str, version: str | None, req: _InferRequest, binary: bytes,
                             outputs: list[tuple[str, dict]], size: int):
        from surge.server import kserve_generate_infer as gen

        p = await gen.prepared(state, size, name, version,
                               functools.partial(decode_inputs, req.inputs, binary), req.parameters,
                               [n for n, _ in outputs])
        arrays = await until_disconnect(request.receive, gen.answer(state, p))
        return _tensors(p.service.name, p.service.version, req, [(n, a) for n, _, a in arrays], outputs)

    def _tensors(model: str, version: str, req: _InferRequest, arrays: list, outputs: list[tuple[str, dict]]):
        """The response of named output arrays, each in JSON or binary as the request asks."""
        binary_default = binary_flag(req.parameters, "binary_data_output", False)
        wants = {n: binary_flag(p, "binary_data", binary_default) for n, p in outputs}
        body = {"model_name": model, "model_version": version, "outputs": []}
        if req.id is not None:
            body["id"] = req.id
        raws = []
        for out_name, array in arrays:
            out = {"name": out_name, "datatype": kserve_tensor.datatype_of(array), "shape": list(array.shape)}
            if wants.get(out_name, binary_default):
                raw = kserve_tensor.raw_bytes(array)
                out["parameters"] = {"binary_data_size": len(raw)}
                raws.append(raw)
            else:
                out["data"] = kserve_tensor.json_data(array)
            body["outputs"].append(out)
        headers = {"x-surge-model-version": version}
        if not raws:
            return ORJSONResponse(body, headers=headers)
        head = orjson.dumps(body)
        headers["Inference-Header-Content-Length"] = str(len(head))
        return Response(head + b"".join(raws), media_type="application/octet-stream", headers=headers)

    infer_doc = {"openapi_extra": body(_InferRequest, binary=True),
                 "responses": {200: {"description": "The outputs (JSON, or a JSON header and binary tensor data)",
                                     "content": {JSON: {}, BINARY: {}}}}}
    r.post("/v2/models/{name}/infer", **infer_doc)(infer)
    r.post("/v2/models/{name}/versions/{version}/infer", **infer_doc)(infer)

    async def _repository_body(request: Request) -> _RepositoryRequest:
        body = await read_body(request, limits.max_body_bytes)
        return _validate(_RepositoryRequest, decode_json(body)) if body.strip() else _RepositoryRequest()

    @r.post("/v2/repository/index", openapi_extra=body(_RepositoryRequest, required=False))
    async def repository_index(request: Request):
        req = await _repository_body(request)
        return ORJSONResponse(contract.repository_index(await lifecycle().index(), req.ready))

    @r.post("/v2/repository/models/{name}/load", openapi_extra=body(_RepositoryRequest, required=False))
    async def repository_load(request: Request, name: str):
        req = await _repository_body(request)
        version = contract.check_load_parameters(req.parameters)
        # Shielded as the native routes: a client that hangs up does not cancel the load halfway.
        await asyncio.shield(asyncio.ensure_future(lifecycle().load(name, version)))
        return ORJSONResponse({})

    @r.post("/v2/repository/models/{name}/unload", openapi_extra=body(_RepositoryRequest, required=False))
    async def repository_unload(request: Request, name: str):
        req = await _repository_body(request)
        version = contract.check_load_parameters(req.parameters)
        await asyncio.shield(asyncio.ensure_future(lifecycle().unload(name, version)))
        return ORJSONResponse({})

    return r

