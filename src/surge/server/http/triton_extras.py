"""Triton's HTTP extras: log settings, trace settings, shared-memory routes.

GET/POST /v2/logging                                   log settings (see server/triton_settings.py)
GET/POST /v2/trace/setting, /v2/models/{m}/trace/setting  trace settings (readable; OFF)
/v2/systemsharedmemory/..., /v2/cudasharedmemory/...   501, as Triton answers what it does not support
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from surge.errors import InvalidInput
from surge.server import triton_settings as settings
from surge.server.http.common import ORJSONResponse, decode_json, read_body
from surge.server.http.openapi import body as body_doc
from surge.server.state import AppState

_OBJECT_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "additionalProperties": True}}}}}


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limit = state.config.limits.max_body_bytes
    settings.init_log_level(state.config.log_level)

    async def body(request: Request) -> dict:
        data = decode_json(await read_body(request, limit))
        if not isinstance(data, dict):
            raise InvalidInput("request body must be a JSON object of settings")
        return data

    @r.get("/v2/logging")
    async def get_logging():
        return ORJSONResponse(settings.log_settings())

    @r.post("/v2/logging", openapi_extra=_OBJECT_BODY)
    async def post_logging(request: Request):
        return ORJSONResponse(settings.update_log_settings(await body(request)))

    async def get_trace(name: str | None = None):
        if name is not None:
            state.registry.get(name)  # 404 for an unknown model
        return ORJSONResponse(settings.trace_settings())

    async def post_trace(request: Request, name: str | None = None):
        if name is not None:
            state.registry.get(name)
        return ORJSONResponse(settings.update_trace_settings(await body(request)))

    r.get("/v2/trace/setting")(get_trace)
    r.get("/v2/models/{name}/trace/setting")(get_trace)
    r.post("/v2/trace/setting", openapi_extra=_OBJECT_BODY)(post_trace)
    r.post("/v2/models/{name}/trace/setting", openapi_extra=_OBJECT_BODY)(post_trace)

    async def unsupported(region: str | None = None):
        settings.shared_memory()

    # Documented as what they answer (501), so that clients and the OpenAPI fuzz know it.
    not_implemented = {501: {"description": "Shared memory is not supported", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/KServeError"}}}}}
    for kind in ("systemsharedmemory", "cudasharedmemory"):
        r.get(f"/v2/{kind}/status", responses=not_implemented)(unsupported)
        r.get(f"/v2/{kind}/region/{{region}}/status", responses=not_implemented)(unsupported)
        r.post(f"/v2/{kind}/region/{{region}}/register", openapi_extra=_OBJECT_BODY,
               responses=not_implemented)(unsupported)
        r.post(f"/v2/{kind}/region/{{region}}/unregister", openapi_extra=body_doc(required=False),
               responses=not_implemented)(unsupported)
        r.post(f"/v2/{kind}/unregister", openapi_extra=body_doc(required=False), responses=not_implemented)(unsupported)
    return r
