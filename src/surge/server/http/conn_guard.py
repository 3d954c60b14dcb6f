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
- A send deadline (nginx's send_timeout): a connection whose transport has bytes waiting to be sent (the
  client's TCP window is full: uvicorn's writing paused by flow control, or the write buffer not empty)
  and from which the client has taken none of them for `send_timeout_s` is aborted. uvicorn has no write
  timeout: a client that asked for a large answer (POST /embed_all, held under its admission slot until
  the kernel has taken its last byte: server/http/held_answer.py; a big /embed batch; a stream) and
  never read it held the connection, the answer's memory and, for /embed_all, an admission slot for ever
  (enough of them and everyone else got 429). The abort is the connection lost, which every route already
  handles as a client that left: uvicorn's `send` stops waiting for the drain, the `surge.disconnect`
  watch (server/http/frontend.py) cancels a hot path's handler (a stream's sequence and KV blocks freed)
  and an answer not all handed to the kernel (server/http/delivery.py; a held answer: held_answer.py) counts
  as cut ("cancelled"), neither its latency observed nor a KServe success. A client that reads, however
  slowly, is never cut: any byte it takes restarts the clock. Bytes the kernel has taken are not waiting here (its socket buffers,
  up to tcp_wmem's 4 MB, fill first); the abort is a reset (SO_LINGER 0, nginx's reset_timedout_connection),
  so the kernel drops them too, and what the app hands over after it is dropped.
"""

from __future__ import annotations

import resource

from surge.server.tcp_info import drop_on_close

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


class SendDeadline:
    """The send timer of one connection (`corked`: its server/http/frontend._Corked transport, which counts
    the bytes handed to the real one): armed by a write that leaves bytes in the transport's buffer;
    `on_expiry` runs once bytes have waited there `seconds` with none of them sent.

    Lazy, as ReadDeadline: a write that the kernel takes at once (nearly every answer) arms nothing, and
    one armed timer looks at the buffer every quarter of `seconds`, so that progress (`corked.progress()`:
    bytes handed to the kernel, and bytes the client acknowledged) is seen within that and a stall is cut
    between `seconds` and 1.25x it after the client last took a byte. Disarmed by itself once the buffer is
    empty."""

    __slots__ = ("_corked", "_handle", "_loop", "_on_expiry", "_seconds", "_progress", "_since")

    def __init__(self, loop, seconds: float, corked, on_expiry):
        self._loop = loop
        self._seconds = seconds
        self._corked = corked
        self._on_expiry = on_expiry
        self._handle = None
        self._progress = 0
        self._since = 0.0

    def arm(self) -> None:
        """After a write: time the bytes it left buffered (nothing if a timer already runs: it sees them)."""
        if self._handle is None:
            self._progress = self._corked.progress()
            self._since = self._loop.time()
            self._handle = self._loop.call_later(self._seconds / 4, self._fire)

    def close(self) -> None:
        """The connection is gone: no timer may keep it (its protocol) alive until it would have fired."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        corked = self._corked
        if not corked.waiting():  # all sent: nothing to time until a write leaves bytes again
            return
        now = self._loop.time()
        progress = corked.progress()
        if progress != self._progress:  # the client took some: its clock starts again
            self._progress, self._since = progress, now
        elif now - self._since >= self._seconds:
            self._on_expiry()
            return
        self._handle = self._loop.call_later(self._seconds / 4, self._fire)


def reset(transport) -> None:
    """Abort `transport` with a TCP reset: what the kernel still holds to send is dropped, not kept."""
    drop_on_close(transport.get_extra_info("socket"))
    transport.abort()


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
