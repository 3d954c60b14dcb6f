"""Model lifecycle over HTTP (native routes):

GET  /models                      every model and version the server knows, with state and reason
GET  /models/{name}               one model's versions
POST /models/{name}/load          load as the version policy says (or `{"version": "2"}`)
POST /models/{name}/unload        stop routing, drain, free (all versions, or one)
POST /models/{name}/reload        rebuild from model.yaml and swap in with zero downtime

The version may also be given as `?version=2`. The work is done by
`state.lifecycle` (the model repository; `surge serve MODEL` is a repository of
one entry); a server without one (a --workers front end, the Ray ingress) only lists its models.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from surge.errors import InvalidInput, NotFound, shown
from surge.server.http.common import ORJSONResponse, decode_json, read_body, validate
from surge.server.http.openapi import body
from surge.server.state import AppState


class LifecycleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: StrictStr | StrictInt | None = None


def router(state: AppState) -> APIRouter:
    r = APIRouter()

    async def listing() -> list[dict]:
        if state.lifecycle is not None:
            return await state.lifecycle.index()
        return [{"name": s.name, "version": s.version, "state": "READY" if s.ready else "LOADING", "reason": "",
                 "serving": s is state.registry.get(s.name), "inflight": 0} for s in state.registry.services()]

    def lifecycle():
        if state.lifecycle is None:
            raise InvalidInput("this server cannot load or unload models at run time (a --workers front end or "
                               "the Ray ingress serves the models it started with)")
        return state.lifecycle

    async def finish(operation) -> None:
        # A client that hangs up must not cancel a load halfway (a version left
        # LOADING, an engine built for nothing): the operation runs to its end.
        await asyncio.shield(asyncio.ensure_future(operation))

    async def version_of(request: Request) -> str | None:
        version = request.query_params.get("version")
        body = await read_body(request, state.config.limits.max_body_bytes)
        if body.strip():
            req = validate(LifecycleRequest, decode_json(body))
            if req.version is not None:
                version = str(req.version)
        return version

    async def one(name: str) -> ORJSONResponse:
        versions = [e for e in await listing() if e["name"] == name]
        if not versions:
            raise NotFound(f"model '{shown(name)}' not found", param="model")
        return ORJSONResponse({"name": name, "versions": versions})

    @r.get("/models")
    async def list_models():
        return ORJSONResponse({"models": await listing(), "default": state.registry.default})

    @r.get("/models/{name}")
    async def get_model(name: str):
        return await one(name)

    optional = body(LifecycleRequest, required=False)

    @r.post("/models/{name}/load", openapi_extra=optional)
    async def load(name: str, request: Request):
        life = lifecycle()
        await finish(life.load(name, await version_of(request)))
        return await one(name)

    @r.post("/models/{name}/unload", openapi_extra=optional)
    async def unload(name: str, request: Request):
        life = lifecycle()
        await finish(life.unload(name, await version_of(request)))
        return await one(name)

    @r.post("/models/{name}/reload", openapi_extra=optional)
    async def reload(name: str, request: Request):
        life = lifecycle()
        version = await version_of(request)
        await finish(life.reload(name, version) if hasattr(life, "reload") else life.load(name, version))
        return await one(name)

    return r

