"""GET /metrics: the runtime's Prometheus metrics, plus the process's own.

- Format: the Prometheus text format, or OpenMetrics when the scraper's Accept
  header asks for `application/openmetrics-text` (prometheus_client's own
  content negotiation, as its exposition server does).
- Process metrics (CPU seconds, resident memory, open files, start time) and the
  Python platform, from prometheus_client's ProcessCollector / PlatformCollector,
  on surge's registry.
- Access: behind the API key like every route, unless the operator says otherwise:
  `--metrics-public` opens /metrics on the HTTP port (server/app.py), and
  `--metrics-port` serves the same registry on a port of its own without the key
  (as Triton's and TEI's metrics ports), started with the app and stopped with it.
"""

from __future__ import annotations

import sys
import weakref

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, PlatformCollector, ProcessCollector,
                               generate_latest)
from prometheus_client.exposition import choose_encoder

from surge.runtime.metrics import default_registry
from surge.server.state import AppState

_WITH_PROCESS: weakref.WeakSet = weakref.WeakSet()  # registries that already carry the process collectors


def add_process_metrics(registry: CollectorRegistry) -> None:
    """process_* and python_info on `registry`, once."""
    if registry in _WITH_PROCESS:
        return
    _WITH_PROCESS.add(registry)
    for collector in (ProcessCollector, PlatformCollector):
        try:
            collector(registry=registry)
        except ValueError:  # already registered there (by an embedding application)
            pass


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    if state.config.metrics.port:
        install_metrics_port(state)

    def registry() -> CollectorRegistry:
        # A registry set on the state (e.g. by an embedding application) wins;
        # services record into the process default otherwise.
        reg = state.extras.get("metrics_registry") or default_registry()
        add_process_metrics(reg)
        return reg

    @r.get("/metrics", include_in_schema=False)
    async def metrics(request: Request):
        sources = state.extras.get("metrics_sources")  # other processes' metrics (Ray replicas)
        if sources is not None:
            from surge.distributed.metrics_hub import merge

            return Response(merge(generate_latest(registry()), await sources()), media_type=CONTENT_TYPE_LATEST)
        encoder, content_type = choose_encoder(request.headers.get("accept"))
        return Response(encoder(registry()), media_type=content_type)

    return r


def install_metrics_port(state: AppState) -> None:
    """Serve the metrics on `metrics.port` (no API key) while the app runs, with the read timeout and (at
    most MAX_CONNECTIONS of) the connection limit of the HTTP port (server/http/metrics_port.py)."""
    from surge.server.http.conn_guard import connection_limit
    from surge.server.http.metrics_port import MAX_CONNECTIONS, start_metrics_server

    config = state.config

    async def start(state: AppState) -> None:
        reg = state.extras.get("metrics_registry") or default_registry()
        add_process_metrics(reg)
        limits = config.limits
        server, thread = start_metrics_server(config.metrics.port, config.host, reg, limits.request_read_timeout_s,
                                              min(MAX_CONNECTIONS, connection_limit(limits.max_connections)))
        state.extras["metrics_http"] = (server, thread)
        print(f"surge: metrics on http://{config.host}:{config.metrics.port}/metrics", file=sys.stderr, flush=True)

    async def stop(state: AppState) -> None:
        running = state.extras.pop("metrics_http", None)
        if running is not None:
            server, thread = running
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

    # First: scrapers see the server (loading, memory) while the models load.
    state.extras.setdefault("on_startup", []).insert(0, start)
    state.extras.setdefault("on_shutdown", []).append(stop)
