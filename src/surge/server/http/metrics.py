"""GET /metrics: the runtime's Prometheus metrics (text exposition format)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from surge.runtime.metrics import default_registry
from surge.server.state import AppState


def router(state: AppState) -> APIRouter:
    r = APIRouter()

    @r.get("/metrics", include_in_schema=False)
    async def metrics():
        # A registry set on the state (e.g. by an embedding application) wins;
        # services record into the process default otherwise.
        registry = state.extras.get("metrics_registry") or default_registry()
        body = generate_latest(registry)
        sources = state.extras.get("metrics_sources")  # other processes' metrics (Ray replicas)
        if sources is not None:
            from surge.distributed.metrics_hub import merge

            body = merge(body, await sources())
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return r
