"""Optional API-key check as a pure ASGI middleware (cheap on the hot path): `Authorization: Bearer <key>`,
or `x-api-key: <key>` as Anthropic's clients send it."""

from __future__ import annotations

import hmac

from surge.server.errors import error_response
from surge.server.tei_errors import is_tei_route
from surge.server.health import OPEN_PATHS


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()
        self._open = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self._open:
            return await self.app(scope, receive, send)
        given = key = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
            elif name == b"x-api-key":
                key = value
        # compare_digest takes the same time whatever prefix matches.
        if not (hmac.compare_digest(given, self._expected) or (key and hmac.compare_digest(key, self._key))):
            resp = error_response(scope["path"], 401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                  type_="invalid_request_error", code="invalid_api_key",
                                  tei=is_tei_route(scope["path"], scope["method"]))
            resp.headers["WWW-Authenticate"] = "Bearer"
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)
