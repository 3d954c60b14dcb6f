"""The ASGI application: routers from each protocol, one error mapping, auth."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from surge import __version__
from surge.server import errors
from surge.server.auth import ApiKeyMiddleware
from surge.server.http.content_type import ContentTypeMiddleware
from surge.server.http.hotpath import HotPathMiddleware, install_outer
from surge.server.http.task_hotpath import TaskHotPathMiddleware
from surge.server.state import AppState


def create_app(state: AppState) -> FastAPI:
    from surge.server import health
    from surge.server.http import (anthropic_messages, kserve, kserve_generate, lora_routes, metrics, models, native,
                                   openai, openai_chat, openapi, pipelines, rerank, responses_api, tei, tei_embeddings,
                                   triton_extras, vllm_tokenize)
    from surge.server.http.compression import DecompressMiddleware

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # Loading runs in the background so that liveness answers at once and
        # readiness turns on only after every model has warmed up.
        state.registry.loading = True
        # A --workers front end shares its listening socket with front ends that serve: it takes no
        # connection before it serves too (uvicorn accepts only once this yields), or a client that saw
        # /ready 200 from another one gets 503 from it. A failed start fails the lifespan (uvicorn exits
        # without accepting; the supervisor starts it again).
        held = state.extras.get("serve_when_ready", False)
        task = asyncio.create_task(_start(state, stop_on_failure=not held))
        state.extras["startup_task"] = task
        try:
            if held:
                await task
                if not state.started:
                    raise RuntimeError(f"startup failed: {state.extras.get('startup_error')}")
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            for hook in state.extras.get("on_shutdown", []):
                with contextlib.suppress(Exception):
                    await hook(state)
            for service in state.registry.services():
                with contextlib.suppress(Exception):
                    await service.close()

    app = FastAPI(title="surge", version=__version__, docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.surge = state
    errors.install(app, tei_embed=state.config.tei_embed)
    openapi.install(app, tei_embed=state.config.tei_embed)
    app.include_router(health.router(state))
    app.include_router(openai.router(state))
    app.include_router(native.router(state))
    app.include_router(kserve.router(state))
    app.include_router(openai_chat.router(state))  # generation (decoder models)
    app.include_router(responses_api.router(state))  # OpenAI's Responses API (decoder models)
    app.include_router(anthropic_messages.router(state))  # Anthropic's Messages API (decoder models)
    app.include_router(kserve_generate.router(state))
    app.include_router(models.router(state))
    app.include_router(lora_routes.router(state))  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter
    app.include_router(pipelines.router(state))
    app.include_router(metrics.router(state))
    app.include_router(triton_extras.router(state))
    app.include_router(tei.router(state))  # TEI / HF Inference shapes (POST /, /predict, /rerank, ...)
    app.include_router(tei_embeddings.router(state))  # TEI's /similarity, /embed_sparse
    app.include_router(vllm_tokenize.router(state))  # vLLM's /detokenize (its /tokenize: tei's route dispatches)
    app.include_router(rerank.router(state))  # POST /v1/rerank (Cohere / Jina)
    for extra in state.extras.get("routers", []):
        app.include_router(extra(state))
    app.add_middleware(HotPathMiddleware, state=state)  # inside auth: added before it
    app.add_middleware(TaskHotPathMiddleware, state=state)  # plain POST /predict (classify), as the embed hot path
    app.add_middleware(DecompressMiddleware, max_bytes=state.config.limits.max_body_bytes)  # gzip/deflate bodies
    app.add_middleware(ContentTypeMiddleware)  # 415 before any route or the hot path reads a body
    if state.config.api_key:
        from surge.server.health import OPEN_PATHS

        # --metrics-public: scrapers that send no key read /metrics.
        open_paths = OPEN_PATHS | ({"/metrics"} if state.config.metrics.public else set())
        app.add_middleware(ApiKeyMiddleware, api_key=state.config.api_key, open_paths=frozenset(open_paths))
    install_outer(app, state)  # plain embedding requests skip the middleware stack (server/http/hotpath.py)
    return app


async def _start(state: AppState, stop_on_failure: bool = True) -> None:
    try:
        for hook in state.extras.get("on_startup", []):
            await hook(state)
        state.registry.loading = False
        from surge.runtime.gc_settle import settle

        settle(state.config.gc_freeze)  # models loaded and warmed up: full GC passes would walk all of it (runtime/gc_settle.py)
        state.started = True
        for hook in state.extras.get("on_started", []):  # readiness watchers (gRPC health)
            hook(state)
    except Exception as exc:  # the process stays up, unready, and says why
        state.registry.loading = False
        state.extras["startup_error"] = f"{type(exc).__name__}: {exc}"
        from surge.errors import SurgeError

        if isinstance(exc, SurgeError):  # a configuration the user can fix: its message says what, no traceback
            logging.getLogger("surge.server").error("startup failed: %s", exc.message)
        else:
            logging.getLogger("surge.server").exception("startup failed")
        if stop_on_failure and state.extras.get("exit_on_startup_failure", True):
            # Nothing to serve: stop uvicorn (the CLI then exits 1). Through its Server where run_server gave it:
            # a SIGTERM would be re-raised by uvicorn once it has stopped (>= 0.29), so the process would die
            # of it (status 143, "Terminated") before the CLI could exit with its own status.
            stop = state.extras.get("stop_server")
            if stop is not None:
                stop()
            else:
                import os
                import signal

                os.kill(os.getpid(), signal.SIGTERM)
