"""Rendering SurgeError (and the framework's own errors) as HTTP responses.

One mapping: the status comes from the exception class. The body shape follows
the protocol of the route: KServe v2 routes get {"error": msg} (is_kserve_path), Anthropic's
(/v1/messages) {"type": "error", "error": {type, message}}, text-embeddings-inference's
{"error": msg, "error_type": T} with TEI's status for T (server/tei_errors.py), the rest OpenAI's
{"error": {message, type, param, code}}, whose type follows the status (surge.errors.openai_type).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from surge.errors import SurgeError, openai_type, shown
from surge.server.http.common import ORJSONResponse
from surge.server.tei_errors import is_tei_route, tei_status, type_of

log = logging.getLogger("surge.server")
MAX_MESSAGE_CHARS = 1024
ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


# Cohere's v2 rerank path (vLLM serves it too) lies under /v2 but is no KServe route: it answers as /v1/rerank.
NOT_KSERVE_PATHS = ("/v2/rerank",)


def is_kserve_path(path: str) -> bool:
    """Whether a path is KServe v2's (its error body {"error": msg}; a POST body without Content-Type taken)."""
    return path.startswith("/v2") and path.rstrip("/") not in NOT_KSERVE_PATHS


def anthropic_type(status: int) -> str:
    """Anthropic's error type of an HTTP status."""
    return ANTHROPIC_TYPES.get(status, "api_error")


def error_response(request_path: str, status: int, message: str, *, type_: str, code: str,
                   param: str | None = None, retry_after: float | None = None,
                   headers: dict | None = None, tei: bool = False, tei_type: str | None = None) -> ORJSONResponse:
    """`tei`: the route is TEI's (is_tei_route), `tei_type` its error type (default: from the status)."""
    message = shown(message, MAX_MESSAGE_CHARS)  # whatever a message repeats, its size is bounded
    if tei:
        body = {"error": message, "error_type": tei_type or type_of(status)}
    elif is_kserve_path(request_path):
        body = {"error": message}
    elif request_path.startswith(ANTHROPIC_PATHS):
        body = {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
    else:
        body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(round(retry_after))))
    return ORJSONResponse(body, status_code=status, headers=headers)


def render(request_path: str, exc: SurgeError, tei: bool = False) -> ORJSONResponse:
    status, tei_type = tei_status(exc) if tei else (exc.http_status, None)
    return error_response(request_path, status, exc.message, type_=exc.openai_type, code=exc.code,
                          param=exc.param, retry_after=exc.retry_after, tei=tei, tei_type=tei_type)


def unexpected(request_path: str, tei: bool = False) -> ORJSONResponse:
    """The routes' catch-all answer (500) to an exception nothing else renders; called while it is being
    handled, so its traceback is logged."""
    log.exception("unhandled error on %s", request_path)
    return error_response(request_path, 500, "internal server error", type_="server_error", code="internal_error",
                          tei=tei)


async def settled(request_path: str, work, tei: bool | None = None):
    """Await `work`: `(result, None)`, or `(None, response)` where it raised a SurgeError (rendered as the
    routes render it) or any other exception (the catch-all's 500). Cancellation is not caught: a gone
    client's request answers nothing. `tei`: whether the route answers TEI's errors (default: from the
    path, for a POST; POST /embed under --tei-embed passes True)."""
    tei = is_tei_route(request_path) if tei is None else tei
    try:
        return await work, None
    except SurgeError as exc:
        return None, render(request_path, exc, tei)
    except Exception:  # noqa: BLE001 - the routes' catch-all answers the same way
        return None, unexpected(request_path, tei)


def _allowed_methods(request: Request) -> str:
    """Every method some route takes on this path. Starlette's own 405 names only the
    first route that matched the path (GET /pipelines/{name} hides its POST twin)."""
    from starlette.routing import Match

    allowed = []
    for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
        scope = {**request.scope, "method": method}
        # BaseRoute.matches: the routing protocol every route (and included router) implements.
        if any(route.matches(scope)[0] is Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)


def install(app: FastAPI, tei_embed: bool = False) -> None:
    """`tei_embed`: POST /embed is TEI's (--tei-embed), so it answers TEI's errors too."""

    def tei(request: Request) -> bool:
        return is_tei_route(request.url.path, request.method, tei_embed)

    @app.exception_handler(SurgeError)
    async def _surge(request: Request, exc: SurgeError):
        return render(request.url.path, exc, tei(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = shown(".".join(str(p) for p in first.get("loc", ()))) or "request"
        return error_response(request.url.path, 422, f"invalid field '{where}': {first.get('msg', 'invalid')}",
                              type_="invalid_request_error", code="unprocessable", param=where, tei=tei(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
        return error_response(request.url.path, exc.status_code, str(exc.detail),
                              type_=openai_type(exc.status_code), code=f"http_{exc.status_code}", headers=headers,
                              tei=tei(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return unexpected(request.url.path, tei(request))
