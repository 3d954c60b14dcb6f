"""Content types of POST requests, checked in one place (a pure-ASGI layer): 415 otherwise.

Why: a web page of another origin can make a browser send a POST without a
CORS preflight when its content type is text/plain, a form type, or absent;
with no check, such a page could unload models or run inference on a server
reachable from the browser. A JSON content type needs a preflight, which this
server never grants (it sends no CORS headers).

- JSON routes (everything but KServe): `application/json` (or `*/*+json`).
  A POST with no body at all (`curl -XPOST .../load`) needs no content type.
- KServe infer: JSON, or the binary tensor extension's types
  (`application/octet-stream`, `application/vnd.sagemaker-triton.binary+json`).
  KServe routes also take a request with no content type, which is what
  tritonclient.http sends (its geventhttpclient sets none), but not from a
  browser on another origin (it would say so in Origin / Sec-Fetch-Site).
"""

from __future__ import annotations

from urllib.parse import urlparse

from surge.server.errors import error_response, is_kserve_path
from surge.server.tei_errors import is_tei_route
from surge.server.http.openapi import BINARY_TYPES

JSON = "application/json"


def _allowed(path: str) -> tuple[str, ...]:
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return (JSON, *BINARY_TYPES)
    return (JSON,)


def _cross_site(headers: dict[bytes, bytes]) -> bool:
    site = headers.get(b"sec-fetch-site")
    if site is not None:
        return site not in (b"same-origin", b"none")
    origin = headers.get(b"origin")
    if origin is None:
        return False  # not a browser, or a same-origin request of an old one
    host = headers.get(b"host", b"").decode("latin-1").lower()
    return urlparse(origin.decode("latin-1")).netloc.lower() != host


class ContentTypeMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # names are lower-case bytes in ASGI
        raw = headers.get(b"content-type")
        path = scope["path"]
        if raw is None:
            has_body = headers.get(b"content-length", b"0").strip() not in (b"0", b"") or b"transfer-encoding" in headers
            if (not has_body or is_kserve_path(path)) and not _cross_site(headers):
                return await self.app(scope, receive, send)
            message = "a request body needs a Content-Type header: send 'Content-Type: application/json'"
        else:
            media = raw.split(b";", 1)[0].strip().decode("latin-1").lower()
            allowed = _allowed(path)
            if media in allowed or (JSON in allowed and media.endswith("+json") and "/" in media
                                    and media not in BINARY_TYPES):
                return await self.app(scope, receive, send)
            shown = media[:64] or "(empty)"
            message = f"unsupported Content-Type '{shown}': send {' or '.join(allowed)}"
        response = error_response(path, 415, message, type_="invalid_request_error", code="unsupported_media_type",
                                  tei=is_tei_route(path, scope["method"]))
        await response(scope, receive, send)
