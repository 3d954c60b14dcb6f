"""DAG pipelines over HTTP (native routes):

GET  /pipelines                   the served pipelines (nodes, inputs, outputs) and load errors
GET  /pipelines/{name}            one pipeline
POST /pipelines/{name}            run it: {"inputs": {...}} or a list of such objects
POST /pipelines/{name}/reload     re-read its pipeline.yaml (the old one serves until the new one is checked)
"""

from __future__ import annotations

import asyncio
from typing import Any, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from surge.errors import DeadlineExceeded, NotFound, PayloadTooLarge, shown
from surge.server.http.common import ORJSONResponse, parse
from surge.server.http.openapi import body
from surge.server.state import AppState


class PipelineRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: Union[dict[str, Any], list[dict[str, Any]]]


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    def pipelines():
        found = state.extras.get("pipelines")
        if found is None:
            raise NotFound("no pipelines are served (they come from a --model-repository)", param="pipeline")
        return found

    @r.get("/pipelines")
    async def list_pipelines():
        found = state.extras.get("pipelines")
        if found is None:
            return ORJSONResponse({"pipelines": [], "errors": {}})
        return ORJSONResponse({"pipelines": [p.describe() for _, p in sorted(found.pipelines.items())],
                               "errors": dict(found.errors)})

    @r.get("/pipelines/{name}")
    async def get_pipeline(name: str):
        return ORJSONResponse(pipelines().get(name).describe())

    @r.post("/pipelines/{name}/reload", openapi_extra=body(required=False))
    async def reload(name: str):
        return ORJSONResponse((await pipelines().reload(name)).describe())

    @r.post("/pipelines/{name}", openapi_extra=body(PipelineRequest))
    async def run(name: str, request: Request):
        pipeline = pipelines().get(name)
        req = await parse(request, PipelineRequest, limits.max_body_bytes)
        items = req.inputs if isinstance(req.inputs, list) else [req.inputs]
        if len(items) > limits.max_inputs_per_request:
            raise PayloadTooLarge(f"'inputs' has {len(items)} items; at most {limits.max_inputs_per_request} "
                                  "are allowed", param="inputs")
        for item in items:
            for key, value in item.items():
                if isinstance(value, str) and len(value) > limits.max_input_chars:
                    raise PayloadTooLarge(f"input '{shown(key)}' has {len(value)} characters; at most "
                                          f"{limits.max_input_chars} are allowed", param=key)
        try:
            results = await asyncio.wait_for(asyncio.gather(*(pipeline.run(i) for i in items)),
                                             limits.request_timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"pipeline did not finish within {limits.request_timeout_s:g} s") from None
        if isinstance(req.inputs, list):
            return ORJSONResponse({"pipeline": name, "results": results})
        return ORJSONResponse({"pipeline": name, **results[0]})

    return r
