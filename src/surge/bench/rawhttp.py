"""A lean HTTP/1.1 client for load generation: one keep-alive connection, one request at a time.

Why not aiohttp here: on the GPU machine aiohttp's client cost ~0.19 ms of CPU per request, so a
load generator driving 18,000 req/s took 3.4 of the 16 cores that the server under test shares
with it (docs/benchmarks/serving_core.md, session 4). This client writes a prebuilt request and
parses only what a benchmark reads (status, Content-Length or chunked framing, the headers it
asks for), in one asyncio Protocol: 8.9x less CPU a request than aiohttp's client on the 2-core
machine (benchmarks/loadgen_clients.py).

Contract (tested in tests/unit/test_rawhttp.py against real servers):
- `RawConnection.request(path, body)` returns `Response(status, headers, body)`; `headers` holds
  the lower-cased names given as `want` (others are not parsed);
- bodies framed by Content-Length or by chunked transfer encoding; a response without either
  (close-delimited) or a closed connection raises `ConnectionError`;
- a server that answers with `Connection: close` is reconnected on the next request;
- `request(..., timeout=T)` raises `TimeoutError` after T seconds without the whole response, and
  closes the connection (a late answer must not be read as the next request's);
- `connect()` opens the connection now (its `OSError` is a failure to connect, not a lost answer);
- `ssl=` an `ssl.SSLContext`: the same over TLS.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class _Proto(asyncio.Protocol):
    def __init__(self, want: tuple[bytes, ...]):
        self.want = want
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            self._parse()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection closed before the response ended: {exc}"))

    def _parse(self) -> None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(buf[:end]).split(b"\r\n")
        try:
            status = int(head[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            self.waiter.set_exception(ConnectionError(f"not an HTTP response: {head[0][:80]!r}"))
            return
        length, chunked, close, headers = None, False, False, {}
        for line in head[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
            if name in self.want:
                headers[name.decode()] = value.strip().decode("latin-1")
        start = end + 4
        if chunked:
            body, used = _dechunk(buf, start)
            if body is None:
                return
        elif length is not None:
            if len(buf) < start + length:
                return
            body, used = bytes(buf[start:start + length]), start + length
        elif status in (204, 304) or 100 <= status < 200:
            body, used = b"", start
        else:
            self.waiter.set_exception(ConnectionError("a response without Content-Length or chunked framing"))
            return
        del buf[:used]
        if close:
            self.closed = True
            self.transport.close()
        self.waiter.set_result(Response(status, headers, body))


def _expire(fut: asyncio.Future, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(f"no whole response within {timeout:g} s"))


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes | None, int]:
    parts = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None, 0
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:  # trailers (none expected) end with an empty line
            end = buf.find(b"\r\n", pos)
            if end < 0:
                return None, 0
            return b"".join(parts), end + 2
        if len(buf) < pos + size + 2:
            return None, 0
        parts.append(bytes(buf[pos:pos + size]))
        pos += size + 2


class RawConnection:
    """One keep-alive connection to host:port; `request` is not re-entrant (one at a time)."""

    def __init__(self, host: str, port: int, want: tuple[str, ...] = (), extra_headers: dict | None = None,
                 ssl=None):
        self.host, self.port = host, port
        self._ssl = ssl  # an ssl.SSLContext for https (the host name is checked against the certificate)
        self._want = tuple(w.lower().encode() for w in want)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (extra_headers or {}).items())
        self._prefix = f"Host: {host}:{port}\r\nContent-Type: application/json\r\n{extra}".encode()
        self._proto: _Proto | None = None

    @property
    def connected(self) -> bool:
        return self._proto is not None and not self._proto.closed

    async def connect(self) -> None:
        if not self.connected:
            await self._connect()

    async def _connect(self) -> _Proto:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(lambda: _Proto(self._want), self.host, self.port, ssl=self._ssl,
                                                server_hostname=self.host if self._ssl else None)
        self._proto = proto
        return proto

    async def request(self, path: str, body: bytes, method: str = "POST", timeout: float | None = None) -> Response:
        proto = self._proto
        if proto is None or proto.closed:
            proto = await self._connect()
        if proto.buf:  # bytes that arrived with no request outstanding: not an answer to this one
            raise ConnectionError("unexpected bytes from the server before the request")
        loop = asyncio.get_running_loop()
        proto.waiter = fut = loop.create_future()
        proto.transport.write(b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
                              % (method.encode(), path.encode(), self._prefix, len(body), body))
        if timeout is None:
            return await fut
        # One timer handle, not a task a request (asyncio.wait_for's cost on Python < 3.12).
        timer = loop.call_later(timeout, _expire, fut, timeout)
        try:
            return await fut
        except TimeoutError:
            self.close()
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
