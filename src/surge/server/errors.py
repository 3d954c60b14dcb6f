"""Rendering SurgeError (and the framework's own errors) as HTTP responses.

One mapping: the status comes from the exception class. The body shape follows
the protocol of the route: KServe v2 routes get {"error": msg}, Anthropic's
(/v1/messages) {"type": "error", "error": {type, message}}, the rest OpenAI's
{"error": {message, type, param, code}}.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from surge.errors import SurgeError, shown
from surge.server.http.common import ORJSONResponse

log = logging.getLogger("surge.server")
MAX_MESSAGE_CHARS = 1024
ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_type(status: int) -> str:
    """Anthropic's error type of an HTTP status."""
    return ANTHROPIC_TYPES.get(status, "api_error")


def error_response(request_path: str, status: int, message: str, *, type_: str, code: str,
                   param: str | None = None, retry_after: float | None = None,
                   headers: dict | None = None) -> ORJSONResponse:
    message = shown(message, MAX_MESSAGE_CHARS)  # whatever a message repeats, its size is bounded
    if request_path.startswith("/v2"):
        body = {"error": message}
    elif request_path.startswith(ANTHROPIC_PATHS):
        body = {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
    else:
        body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(round(retry_after))))
    return ORJSONResponse(body, status_code=status, headers=headers)


def render(request_path: str, exc: SurgeError) -> ORJSONResponse:
    return error_response(request_path, exc.http_status, exc.message, type_=exc.openai_type, code=exc.code,
                          param=exc.param, retry_after=exc.retry_after)


def unexpected(request_path: str) -> ORJSONResponse:
    """The routes' catch-all answer (500) to an exception nothing else renders; called while it is being
    handled, so its traceback is logged."""
    log.exception("unhandled error on %s", request_path)
    return error_response(request_path, 500, "internal server error", type_="server_error", code="internal_error")


async def settled(request_path: str, work):
    """Await `work`: `(result, None)`, or `(None, response)` where it raised a SurgeError (rendered as the
    routes render it) or any other exception (the catch-all's 500). Cancellation is not caught: a gone
    client's request answers nothing."""
    try:
        return await work, None
    except SurgeError as exc:
        return None, render(request_path, exc)
    except Exception:  # noqa: BLE001 - the routes' catch-all answers the same way
        return None, unexpected(request_path)


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


def install(app: FastAPI) -> None:
    @app.exception_handler(SurgeError)
    async def _surge(request: Request, exc: SurgeError):
        return render(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = shown(".".join(str(p) for p in first.get("loc", ()))) or "request"
        return error_response(request.url.path, 422, f"invalid field '{where}': {first.get('msg', 'invalid')}",
                              type_="invalid_request_error", code="unprocessable", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
        return error_response(request.url.path, exc.status_code, str(exc.detail),
                              type_="invalid_request_error", code=f"http_{exc.status_code}", headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return unexpected(request.url.path)
