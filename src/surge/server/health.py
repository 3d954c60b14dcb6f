"""Liveness and readiness. Ready only after every model has warmed up."""

from __future__ import annotations

from fastapi import APIRouter

from surge.server.http.common import ORJSONResponse
from surge.server.http.openapi import JSON
from surge.server.state import AppState

# Paths that skip the API key check (load balancers probe them unauthenticated).
OPEN_PATHS = frozenset({"/health", "/ready", "/v2/health/live", "/v2/health/ready"})


def router(state: AppState) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def live():
        return ORJSONResponse({"status": "ok"})

    not_ready = {"type": "object", "required": ["status"],
                 "properties": {"status": {"type": "string"}, "error": {"type": "string"}}}

    @r.get("/ready", responses={503: {"description": "Not ready", "content": {JSON: {"schema": not_ready}}}})
    async def ready():
        if state.ready:
            return ORJSONResponse({"status": "ready", "models": state.registry.names()})
        body = {"status": "not ready"}
        if state.extras.get("startup_error"):
            body["error"] = state.extras["startup_error"]
        return ORJSONResponse(body, status_code=503)

    return r
