"""Bounds on what a client can hold without finishing a request (server/http/frontend.py's protocol).

uvicorn has neither: a connection that sends nothing, headers that never end, or a body shorter than
its Content-Length was held for ever (its keep-alive timer only runs between requests), and it accepts
connections until the process runs out of file descriptors, after which it accepts nothing (not even
/health), and loading a model or opening the gRPC port fails too. No request is authenticated before
its headers are read, so neither needed the API key.

- A read deadline: a request must be read whole (headers and body) within `request_read_timeout_s` of
  its first byte, or of the connection's opening for its first request; then 408 and the connection
  closes. A request being answered, or a connection kept alive between requests, is not timed here.
- A header limit: a request line and headers longer than `max_header_bytes` get 431 and the connection
  closes (uvicorn kept them all, ~10 bytes of memory per byte sent, before the API key was checked).
- A connection limit: over `max_connections` open connections a new one gets 503 at once and is closed,
  before anything is read from it, so that it holds its descriptor for no time at all.
"""

from __future__ import annotations

import resource

RESERVED_FDS = 256  # descriptors kept for the process's own files when the limit follows RLIMIT_NOFILE


def connection_limit(configured: int | None, ports: int = 1) -> int:
    """The connection limit of one port: `configured`, or the descriptors left after RESERVED_FDS, split
    between the `ports` that accept connections (HTTP, and gRPC when it is on: server/grpc/server.py), so
    that all of them full still leave the process its own descriptors."""
    if configured is not None:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(1, (soft - RESERVED_FDS) // ports)


def limited_ports(config) -> int:
    """How many ports of a ServerConfig share the descriptors: HTTP, and gRPC if on."""
    return 2 if config.grpc_port else 1


def _answer(status: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n" + extra
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


TIMED_OUT = _answer(b"408 Request Timeout",
                    b'{"error":{"message":"the request was not received in time","type":"invalid_request_error",'
                    b'"code":"request_timeout"}}')
HEADERS_TOO_LARGE = _answer(b"431 Request Header Fields Too Large",
                            b'{"error":{"message":"the request line and headers exceed the limit",'
                            b'"type":"invalid_request_error","code":"headers_too_large"}}')
OVERLOADED = _answer(b"503 Service Unavailable",
                     b'{"error":{"message":"too many open connections; retry later","type":"server_error",'
                     b'"code":"overloaded"}}', b"retry-after: 1\r\n")


class ReadDeadline:
    """The read timer of one connection: armed when a request begins (or the connection opens), disarmed
    once it has been read whole; `on_expiry` runs if a request stays armed for `seconds`.

    Lazy, because it is on every request's path: arming and disarming only set the start time, and one
    timer a connection wakes at the earliest possible expiry and looks again (a call_later and a cancel a
    request cost ~5% of the CPU front end's throughput at 64 clients). A connection left idle keeps no timer."""

    __slots__ = ("_loop", "_seconds", "_on_expiry", "_handle", "_start")

    def __init__(self, loop, seconds: float, on_expiry):
        self._loop = loop
        self._seconds = seconds
        self._on_expiry = on_expiry
        self._handle = None
        self._start: float | None = None

    def arm(self) -> None:
        if self._start is None:
            self._start = self._loop.time()
            if self._handle is None:
                self._handle = self._loop.call_later(self._seconds, self._fire)

    def disarm(self) -> None:
        self._start = None

    def close(self) -> None:
        """The connection is gone: no timer may keep it (its protocol) alive until it would have fired."""
        self._start = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        start = self._start
        if start is None:  # read whole since: nothing to time until the next request begins
            return
        left = start + self._seconds - self._loop.time()
        if left > 0:  # armed again after the timer was set: wait for the rest of this request's time
            self._handle = self._loop.call_later(left, self._fire)
            return
        self._start = None
        self._on_expiry()


def expire(protocol, begun: bool) -> None:
    """A request not read in time: 408 if part of it came (`begun`) and its response has not started,
    then close. A connection on which nothing came is closed without a word, as nginx does: a client that
    opened it ahead of use would read an unasked 408 as the answer to its next request. An ASGI task still
    waiting for the body sees the disconnect, and what it sends later is dropped."""
    transport = protocol.transport
    if transport is None or transport.is_closing():
        return
    cycle = getattr(protocol, "cycle", None)  # on a kept-alive connection: maybe the last request's, answered
    if begun and (cycle is None or getattr(cycle, "response_complete", False)
                  or not getattr(cycle, "response_started", False)):
        transport.write(TIMED_OUT)
    transport.close()
