"""Compressed request bodies: `Content-Encoding: gzip` or `deflate` (tritonclient's
`request_compression_algorithm`, and any HTTP client that compresses).

A pure-ASGI layer inside the API-key check (an unauthenticated body is never
inflated) and outside everything that reads bodies: it reads the compressed
body (bounded by the body limit), inflates it with a bound on the output (the
same limit: a larger body, or a zip bomb, gets 413 without being inflated
further), and hands the routes a plain body with a matching Content-Length.
"""

from __future__ import annotations

import zlib

from surge.server.errors import error_response
from surge.server.tei_errors import is_tei_route

class _TooLarge(ValueError):
    pass


_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}


class DecompressMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        encoding = next((v for k, v in scope["headers"] if k == b"content-encoding"), b"").strip().lower()
        if encoding in (b"", b"identity"):
            return await self.app(scope, receive, send)
        path = scope["path"]

        async def fail(status: int, message: str, code: str):
            await error_response(path, status, message, type_="invalid_request_error", code=code,
                                 tei=is_tei_route(path, scope["method"]))(
                scope, receive, send)

        if encoding not in _WBITS:
            return await fail(415, f"Content-Encoding '{encoding.decode('latin-1')}' is not supported "
                                   "(gzip, deflate or identity)", "unsupported_media_type")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await fail(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                                  "payload_too_large")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            body = self._inflate(raw, _WBITS[encoding]) if raw else raw  # no body (a GET): nothing to inflate
        except _TooLarge as exc:
            return await fail(413, str(exc), "payload_too_large")
        except ValueError as exc:
            return await fail(400, str(exc), "invalid_input")
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
        headers.append((b"content-length", str(len(body)).encode()))
        given = False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: the client's disconnect

        await self.app({**scope, "headers": headers}, replay, send)

    def _inflate(self, data: bytes, wbits: int) -> bytes:
        attempts = [wbits] if wbits != zlib.MAX_WBITS else [wbits, -zlib.MAX_WBITS]  # deflate: zlib or raw
        for i, bits in enumerate(attempts):
            inflater = zlib.decompressobj(bits)
            try:
                out = inflater.decompress(data, self.max_bytes + 1)
            except zlib.error as exc:
                if i + 1 < len(attempts):
                    continue
                raise ValueError(f"request body is not valid {'gzip' if bits > 16 else 'deflate'} data ({exc})")
            if len(out) > self.max_bytes or inflater.unconsumed_tail:
                raise _TooLarge(f"decompressed request body exceeds the limit of {self.max_bytes} bytes")
            if not inflater.eof:
                raise ValueError("request body ends inside its compressed data (truncated)")
            return out
        raise AssertionError("unreachable")
