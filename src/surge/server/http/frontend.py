"""What a `--workers` front end puts between uvicorn and the app: fewer layers, fewer syscalls.

Measured on a front end under load (benchmarks/frontend_cpu.py, py-spy; docs/benchmarks/
serving_core.md, "Session 2: front-end CPU"):

- `FrontDoor`: FastAPI's own `__call__` asks OpenTelemetry for its tracer, meter and logger
  providers on every request (~2.5% of a front end's CPU) before Starlette's `__call__` reaches
  the middleware stack. With telemetry off (checked once, at the first request) and no root_path,
  an HTTP request goes straight to the built stack, whose outermost layer is the embedding hot
  path (server/http/hotpath.OuterHotPath); the stack itself is unchanged, so every route,
  error and middleware behaves as before. Anything else (lifespan, telemetry on) takes the app.
- `CorkedHttpToolsProtocol`: uvicorn writes a response's head and its body with two
  `transport.write` calls, each a `send` syscall; here a response's writes are joined and sent
  once, as soon as the response is complete (other writes of a pass: right after the pass). It also
  offers the hot path a disconnect callback (`DisconnectWatch`), so that noticing a client that
  went away costs no watcher task per request, and a word once what was written is all the kernel's
  (`DisconnectWatch.unsent`, `when_sent`: every HTTP answer counts answered by them, server/http/delivery.py),
  and bounds what a client can hold without sending or
  reading (server/http/conn_guard.py: read deadline, header and connection limits, send deadline).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from surge.server.tcp_info import bytes_acked


class FrontDoor:
    def __init__(self, app):
        self.app = app
        self._direct: bool | None = None  # decided at the first HTTP request (after startup)
        self._routes = None  # server/http/direct.DirectRoutes, made at the first connection that asks
        self._limits = None  # (read timeout, send timeout, connection limit, header limit), read at the first connection

    def limits(self) -> tuple[float, float, int, int]:
        """(request read timeout in seconds, send timeout in seconds, connection limit, header bytes limit)
        for server/http/conn_guard.py."""
        if self._limits is None:
            from surge.server.http.conn_guard import connection_limit, limited_ports

            config = self.app.state.surge.config
            limits = config.limits
            self._limits = (limits.request_read_timeout_s, limits.send_timeout_s,
                            connection_limit(limits.max_connections, limited_ports(config)), limits.max_header_bytes)
        return self._limits

    def direct(self):
        """The plain requests answered at the protocol (server/http/direct.py), or None where the
        app's layers must see every request: a root path, telemetry on, an API key."""
        if self._direct is None:
            self._direct = self._decide()
        if not self._direct:
            return None
        if self._routes is None:
            state = getattr(getattr(self.app, "state", None), "surge", None)
            if state is None or state.config.api_key:
                self._routes = False
            else:
                from surge.server.http.direct import DirectRoutes

                self._routes = DirectRoutes(state)
        return self._routes or None

    def _decide(self) -> bool:
        app = self.app
        if getattr(app, "root_path", ""):
            return False
        telemetry = getattr(app, "_native_telemetry", None)
        try:
            return telemetry is None or not telemetry.enabled()
        except Exception:  # noqa: BLE001 - unknown FastAPI internals: keep its own path
            return False

    async def __call__(self, scope, receive, send):
        stack = getattr(self.app, "middleware_stack", None)
        if stack is not None and scope["type"] == "http":
            direct = self._direct
            if direct is None:
                direct = self._direct = self._decide()
            if direct:
                scope["app"] = self.app  # what Starlette's __call__ sets
                return await stack(scope, receive, send)
        return await self.app(scope, receive, send)


class _Corked:
    """A transport whose writes during one loop pass go out as one write after it. It counts the bytes
    handed to the real transport, and a write that leaves some of them buffered (the client's window is
    full) arms the connection's send deadline (`deadline`: server/http/conn_guard.SendDeadline)."""

    __slots__ = ("_t", "_loop", "_buf", "written", "deadline", "closed")

    def __init__(self, transport, loop):
        self._t = transport
        self._loop = loop
        self._buf: list[bytes] = []
        self.written = 0
        self.deadline = None
        # closed by the server (uvicorn after a `Connection: close` answer), not aborted: a transport closed so
        # reports the loss (connection_lost(None)) only once its buffer is all the kernel's
        self.closed = False

    def write(self, data) -> None:
        if not self._buf:
            self._loop.call_soon(self._flush)
        self._buf.append(bytes(data))

    def writelines(self, seq) -> None:
        for data in seq:
            self.write(data)

    def _flush(self) -> None:
        if self._buf:
            data = b"".join(self._buf) if len(self._buf) > 1 else self._buf[0]
            self._buf.clear()
            t = self._t
            if not t.is_closing():
                t.write(data)
                self.written += len(data)
                if self.deadline is not None and t.get_write_buffer_size():
                    self.deadline.arm()

    def close(self) -> None:
        self._flush()
        self.closed = True
        self._t.close()

    def write_eof(self) -> None:
        self._flush()
        self._t.write_eof()

    def abort(self) -> None:
        self._buf.clear()
        self.closed = False  # what the buffer held is dropped
        self._t.abort()

    def get_write_buffer_size(self) -> int:
        return self._t.get_write_buffer_size() + sum(map(len, self._buf))

    def waiting(self) -> bool:
        """Bytes handed to the real transport that it has not yet sent."""
        return self._t.get_write_buffer_size() > 0

    def progress(self) -> tuple[int, int | None]:
        """What grows as the client reads: the bytes the real transport has handed to the kernel, and those the
        client has acknowledged (server/tcp_info.py; the kernel reports room in its buffers only once a third
        or so has drained, so a slow steady reader could otherwise look stalled for seconds)."""
        return self.written - self._t.get_write_buffer_size(), bytes_acked(self._t.get_extra_info("socket"))

    def __getattr__(self, name):  # everything else: the real transport
        return getattr(self._t, name)


class DisconnectWatch:
    """The `surge.disconnect` ASGI extension: callbacks run once when the connection is lost.

    The hot path (server/http/hotpath.py) registers one per request instead of a task awaiting
    `receive()` for the disconnect (a task, an Event wait and a cancel per request)."""

    __slots__ = ("_sent", "_transport", "callbacks", "flushed", "lost")

    def __init__(self, sent=None, transport=None):
        self.lost = False
        self.flushed = False  # lost only after every byte written on it was the kernel's (the server closed it)
        self.callbacks: set = set()
        self._sent = sent  # the protocol's _when_sent
        self._transport = transport  # the protocol's _Corked

    def unsent(self) -> bool:
        """Bytes handed to the real transport that the kernel has not taken (they wait in the server's buffers):
        asked right after an answer's last write (runtime/outcome.AtWrite.written), which counts it at once when
        there are none, as nearly always. Without a corked transport: when_sent decides."""
        t = self._transport
        return True if t is None else bool(t._buf) or t.waiting()  # not flushed yet: when_sent flushes it

    def when_sent(self, callback) -> None:
        """`callback(True)` once every byte written on the connection so far has been handed to the kernel
        (at once when it has, or when the server has closed the connection after flushing it: a `Connection:
        close` answer), `callback(False)` if the connection is lost first (server/http/delivery.py)."""
        if self.lost:
            callback(self.flushed)
        elif self._sent is None:
            callback(True)
        else:
            self._sent(callback)

    def add(self, callback) -> bool:
        """Watch; False when the connection is already lost (the callback is not kept)."""
        if self.lost:
            return False
        self.callbacks.add(callback)
        return True

    def discard(self, callback) -> None:
        self.callbacks.discard(callback)

    def fire(self) -> None:
        self.lost = True
        callbacks, self.callbacks = self.callbacks, set()
        for cb in callbacks:
            cb()


def find_front(app) -> "FrontDoor | None":
    """The FrontDoor under uvicorn's app wrappers (its proxy-headers middleware), if any."""
    for _ in range(6):
        if isinstance(app, FrontDoor):
            return app
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


# A front end's hand-over of new connections to its engine process (server/http/handoff.py),
# set by cli/workers.py; None: every connection is served here.
HANDOFF = None


class CorkedHttpToolsProtocol(HttpToolsProtocol):
    _handed = False
    _offer = True  # False for a connection the engine process handed back: it stays here
    _direct = None  # server/http/direct.DirectRoutes: plain requests answered without the ASGI cycle
    _hot = None  # (cycle, path, body so far) of a request answered by _direct, until it is read whole
    _deadline = None  # server/http/conn_guard.ReadDeadline: the request being read must arrive in time
    _header_limit = 0  # most bytes of a request's URL and headers (0: no limit), counted in _header_bytes
    _header_bytes = 0
    _begun = False  # part of a request has come and not all of it (what the read deadline times)
    _refused = False  # headers over the limit: answered 431 and closing; the parser's callbacks do nothing
    _sent_waiters = None  # DisconnectWatch.when_sent's callbacks until the transport's buffer is empty
    _limits = None  # the transport's (low, high) write buffer limits while they wait

    def connection_made(self, transport) -> None:  # type: ignore[override]
        handoff = HANDOFF
        if self._offer and handoff is not None and handoff.offer(transport, self._sibling):
            self._handed = True  # the engine process's connection now: nothing more happens here
            return
        loop = asyncio.get_running_loop()
        corked = _Corked(transport, loop)
        self.watch = DisconnectWatch(self._when_sent, corked)
        super().connection_made(corked)
        front = find_front(self.app)
        if front is not None:  # slow or idle clients and too many connections (server/http/conn_guard.py)
            from surge.server.http import conn_guard

            timeout, send_timeout, most, self._header_limit = front.limits()
            if len(self.connections) > most:
                self.transport.write(conn_guard.OVERLOADED)
                self.transport.close()  # before reading anything: this connection holds nothing
                return
            self._deadline = conn_guard.ReadDeadline(loop, timeout, self._read_expired)
            self._deadline.arm()  # the first request's first byte is awaited no longer than its whole
            self.transport.deadline = conn_guard.SendDeadline(loop, send_timeout, self.transport, self._send_expired)
        if self.limit_concurrency is None:  # uvicorn's 503 above a limit counts ASGI tasks: keep its path
            from surge.server.http.direct import find_direct

            self._direct = find_direct(self.app)

    def _read_expired(self) -> None:
        flow = self.flow
        if flow is not None and flow.read_paused:  # this server stopped reading (a pipelined request waits
            self._deadline.arm()  # for the one before it, or the app reads slowly): not the client's delay
            return
        from surge.server.http.conn_guard import expire

        expire(self, self._begun)

    def _send_expired(self) -> None:
        """The client has taken nothing of what waits to be sent for the send timeout: the connection is
        reset and lost (connection_lost ends its request as a client's leaving does). A reset (SO_LINGER 0,
        as nginx's reset_timedout_connection) rather than a close: the kernel drops what its buffers hold for
        this client (up to tcp_wmem's 4 MB) at once, instead of keeping it in FIN_WAIT1 for a client that
        does not read."""
        from surge.server.http.conn_guard import reset

        reset(self.transport)

    # uvicorn keeps every header (as a list of tuples, ~10 bytes of memory per byte sent) with no bound,
    # before any route or the API key sees them: counted here, refused past the limit.
    def on_url(self, url: bytes) -> None:
        if self._count_header(url):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._count_header(name, value):
            super().on_header(name, value)

    def _count_header(self, *parts: bytes) -> bool:
        if self._refused:
            return False
        if self._header_limit:
            self._header_bytes += sum(map(len, parts))
            if self._header_bytes > self._header_limit:
                from surge.server.http.conn_guard import HEADERS_TOO_LARGE

                self._refused = True
                if self._deadline is not None:
                    self._deadline.disarm()
                self.transport.write(HEADERS_TOO_LARGE)
                self.transport.close()  # stops reading; what the parser still holds is ignored
                return False
        return True

    def on_message_begin(self) -> None:
        if self._refused:
            return
        self._header_bytes = 0
        self._begun = True
        # A request answered inside the parser's callback (a direct cache hit) arms the keep-alive
        # timer; a pipelined request behind it in the same read must not be cut off by it.
        self._unset_keepalive_if_required()
        if self._deadline is not None:
            self._deadline.arm()
        super().on_message_begin()
        scope = getattr(self, "scope", None)  # uvicorn's request scope (without it: the watcher task)
        if isinstance(scope, dict):
            scope.setdefault("extensions", {})["surge.disconnect"] = self.watch

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        direct = self._direct
        # Not while answers wait to be sent (the transport past its high-water mark): a direct answer is
        # written at once and the next pipelined request read, so a client that pipelines requests and reads
        # slowly (never cut by the send deadline) had every answer held here. uvicorn's ASGI path waits for
        # the drain before each answer and reads no further meanwhile.
        if direct is not None and not self.flow.write_paused and (self.cycle is None or self.cycle.response_complete) \
                and not self.pipeline:
            path = direct.takes(self)
            if path is not None:
                from surge.server.http.direct import HotCycle

                keep = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
                self._hot = (HotCycle(keep), path, bytearray())
                self.cycle = self._hot[0]  # a next (pipelined) request waits for this one's answer
                return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        if self._hot is not None:
            self._hot[2].extend(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._begun = False
        if self._deadline is not None:  # read whole: answering it is the request timeout's business
            self._deadline.disarm()
        hot = self._hot
        if hot is not None:
            self._hot = None
            self._direct.answer(self, hot[0], hot[1], bytes(hot[2]))
            return
        super().on_message_complete()

    def hand_back(self, body: bytes) -> None:
        """The request _direct declined after reading its body: uvicorn's ASGI path, as if its
        headers had just completed and its body arrived (called inside the parser's callback)."""
        self.cycle = None
        HttpToolsProtocol.on_headers_complete(self)
        HttpToolsProtocol.on_body(self, body)
        HttpToolsProtocol.on_message_complete(self)

    def on_response_complete(self) -> None:
        # A finished response goes out now, not after the loop pass: the pass's bookkeeping (the
        # buffered metrics, the KServe statistics: runtime/metrics_buffer.py, server/state.py) then
        # runs while the answer is on its way instead of before it.
        transport = self.transport
        if isinstance(transport, _Corked):
            transport._flush()
        super().on_response_complete()

    def _when_sent(self, callback) -> None:
        """DisconnectWatch.when_sent. The transport tells the protocol when its buffer has drained below its low
        water mark (resume_writing); with both marks at 0 while callbacks wait, that is when it is empty. Every
        byte handed over by then is the kernel's, and a lost connection (a reset drops the buffer) never says so."""
        corked = self.transport
        if isinstance(corked, _Corked):
            corked._flush()
            real = corked._t
        else:  # pragma: no cover - this protocol always corks
            real = corked
        if not real.get_write_buffer_size():
            callback(True)
            return
        if self._sent_waiters is None:
            self._sent_waiters = []
            self._limits = real.get_write_buffer_limits()
            real.set_write_buffer_limits(high=0, low=0)  # pauses writing (uvicorn's next send waits for it)
        self._sent_waiters.append(callback)

    def resume_writing(self) -> None:
        super().resume_writing()
        waiters = self._sent_waiters
        if waiters is not None:
            real = getattr(self.transport, "_t", self.transport)
            if real.get_write_buffer_size():  # pragma: no cover - the transport resumes at its low mark, 0 here
                return
            self._sent_waiters = None
            low, high = self._limits
            real.set_write_buffer_limits(high=high, low=low)
            for callback in waiters:
                callback(True)

    def connection_lost(self, exc) -> None:
        if self._handed:
            return
        if self._deadline is not None:
            self._deadline.close()
        sending = getattr(self.transport, "deadline", None)
        if sending is not None:
            sending.close()
        # Lost with no error after the server's own close (not an abort): the transport reports that only once
        # its buffer is all the kernel's, so what waits for that was sent. The race it settles: uvicorn closes
        # a `Connection: close` connection right after the answer's last write, and when the kernel takes that
        # write whole the loss comes in the next loop pass, before a held answer asks when_sent.
        flushed = exc is None and getattr(self.transport, "closed", False)
        self.watch.flushed = flushed
        super().connection_lost(exc)
        self.watch.fire()
        waiters, self._sent_waiters = self._sent_waiters, None
        for callback in waiters or ():  # what they wait for was sent only if the close flushed it
            callback(flushed)

    def _sibling(self) -> "CorkedHttpToolsProtocol":
        """A protocol like this one for a connection handed back by the engine process."""
        p = type(self)(config=self.config, server_state=self.server_state, app_state=self.app_state)
        p._offer = False
        return p


class HandedProtocol(CorkedHttpToolsProtocol):
    """The engine process's protocol for a connection a front end handed over (server/http/handoff.py).

    `handed` (set by its maker, a handoff.Handed) gives the connection's slot back when it closes,
    and takes it back to its front end when a response completes while the front ends keep the
    engine busy and nothing of a next request has been read."""

    handed = None
    _offer = False
    _rx = 0  # data_received calls
    _rx_done = 0  # _rx when the last request was complete
    _in_msg = False  # a request is being parsed

    def data_received(self, data: bytes) -> None:
        self._rx += 1
        super().data_received(data)

    def on_message_begin(self) -> None:
        self._in_msg = True
        super().on_message_begin()

    def on_message_complete(self) -> None:
        self._in_msg = False
        self._rx_done = self._rx
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        handed = self.handed
        if handed is None or not handed.busy():
            return
        t = self.transport
        # Nothing of a next request read (not parsing, no data since the last complete one, none
        # queued) and the response fully out of this process: the front end can go on from here.
        if (self._in_msg or self._rx != self._rx_done or self.pipeline or t.is_closing()
                or t.get_write_buffer_size()):
            return
        t.pause_reading()
        if handed.hand_back():
            t.abort()  # this process's descriptor only (Handed.closed does no shutdown now)
        else:
            t.resume_reading()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        if self.handed is not None:
            self.handed.closed()
