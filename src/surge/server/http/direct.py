"""Plain embedding and classify requests answered at the HTTP protocol, without the ASGI request cycle.

The hot paths (server/http/hotpath.py, task_hotpath.py) already skip FastAPI for plain requests, but
under load such a request still went through uvicorn's ASGI machinery: a scope built from the parsed
URL, a RequestResponseCycle with its Event, the proxy-headers and front-door layers, the replayed
`receive`, and two `send` messages that uvicorn validates and re-encodes: ~17% of the event loop's
py-spy samples serving the INT8 MiniLM artifact on the 2-core VM. Here the protocol
(server/http/frontend.CorkedHttpToolsProtocol) hands such a request's body to `DirectRoutes.answer`
as soon as it is complete, which answers it with the hot paths' own decisions and bytes. Measured
(docs/benchmarks/serving_core.md, "Session 17"): the H200 host's front ends spend 14% less CPU a
request, +6% req/s at 256 clients.

Contract (tests/integration/test_direct_http.py: real TCP, the real app under uvicorn):
- taken only where the hot paths would surely answer: POST to exactly /embed, /v1/embeddings or
  /predict, Content-Type application/json, no Content-Encoding, no Expect, a Content-Length within
  the body limit and hotpath.HOT_MAX_BYTES, no API key, no root path and no telemetry (FrontDoor's decision), no request of
  the same connection still being answered; everything else goes through uvicorn's ASGI path;
- a body the hot paths would not answer themselves (options, token ids, pairs, invalid JSON, an
  unknown model, another task) is handed back to the ASGI path as if it had just arrived, so the
  routes answer it as before;
- the answer's body and headers are the hot paths' (`HotPathMiddleware._payload`,
  `task_hotpath.predict_payload`, `render` for errors) after uvicorn's default headers (date,
  server); `Connection: close` and HTTP/1.0 close the connection after the answer, as uvicorn does;
  pipelined requests are answered in order;
- a client that disconnects cancels its request (the runtime drops its queued inputs);
- a request counts answered (latency, KServe statistics) once the kernel has taken its answer's last byte, and
  "cancelled" where the connection is lost first (server/http/delivery.py): counted at write time by its
  HotCycle, a runtime/outcome.AtWrite that the request's task awaits (a cache hit: inside the protocol's
  callback), at once and with nothing more made where the kernel takes the answer whole, as nearly always;
- graceful shutdown waits for answers in flight (their tasks are the server's tasks).
"""

from __future__ import annotations

import time

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from surge.runtime.outcome import CANCELLED, AtWrite, awaiting, stop_awaiting
from surge.server.errors import settled
from surge.server.http.hotpath import _EMBED, _OPENAI, HOT_MAX_BYTES, HotPathMiddleware, cached_answer
from surge.server.http.task_hotpath import TaskHotPathMiddleware, predict_payload

_PREDICT = "/predict"
_PATHS = {_EMBED.encode(): _EMBED, _OPENAI.encode(): _OPENAI, _PREDICT.encode(): _PREDICT}


class HotCycle(AtWrite):
    """What uvicorn's protocol reads of a request cycle, for a request answered here: its
    pipelining (a next request waits while `response_complete` is False), `shutdown()`
    (keep_alive) and `connection_lost()` (disconnected, message_event). And the request's AtWrite:
    what it counts answered, counted as its answer is written (server/http/delivery.py)."""

    __slots__ = ("disconnected", "keep_alive", "message_event", "response_complete")

    def __init__(self, keep_alive: bool):
        # AtWrite.__init__, inlined: one per request
        self.settled, self.code, self._waiting, self._metrics, self._record = False, None, None, None, None
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        self.message_event = self  # connection_lost sets it: nothing waits on it here

    def set(self) -> None:
        pass


class DirectRoutes:
    def __init__(self, state):
        self.state = state
        self.hot = HotPathMiddleware(None, state)
        self.task = TaskHotPathMiddleware(None, state)
        self.max_body = state.config.limits.max_body_bytes

    def takes(self, proto) -> str | None:
        """The path when the protocol's current request (headers complete) is answered here."""
        path = _PATHS.get(proto.url)
        if path is None or proto.expect_100_continue or proto.parser.get_method() != b"POST":
            return None
        length = ctype = None
        for name, value in proto.headers:
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    return None
                length = int(value)
            elif name == b"content-type":
                ctype = value
            elif name in (b"content-encoding", b"transfer-encoding", b"upgrade"):
                return None
        if length is None or length > min(self.max_body, HOT_MAX_BYTES) or ctype is None:
            return None
        if ctype.split(b";", 1)[0].strip().lower() != b"application/json":
            return None
        return path

    def answer(self, proto, cycle: HotCycle, path: str, body: bytes) -> None:
        """Answer the request now (a cache hit), in a task (a miss), or hand it back to the ASGI path."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return proto.hand_back(body)
        if type(data) is not dict:
            return proto.hand_back(body)
        if path == _PREDICT:
            plain = self.task.plain_request(data)
            if plain is None:
                return proto.hand_back(body)
            return self._start(proto, self._predict(proto, cycle, *plain))
        plain = self.hot.plain_request(path, data)
        if plain is None:
            return proto.hand_back(body)
        native, texts, service, model = plain
        start = time.perf_counter_ns()
        token = awaiting(cycle)  # the hit's latency held by the cycle until its answer is written
        try:
            result = cached_answer(service, texts, native or self.hot.limits.auto_truncate)
        finally:
            stop_awaiting(token)  # the protocol's callback: its context outlives this request
        if result is not None:
            cycle.record(self.state.record, service, result, time.perf_counter_ns() - start)  # KServe statistics
            payload, version, extra = self.hot._payload(native, model, result)
            return _respond(proto, cycle, 200, payload, version, extra)
        self._start(proto, self._run(proto, cycle, path, native, texts, service, model))

    @staticmethod
    def _start(proto, coro) -> None:
        """Run the request's coroutine as a task of the server, cancelled if its client goes away."""
        task = proto.loop.create_task(coro)
        proto.tasks.add(task)  # uvicorn's graceful shutdown waits for these
        task.add_done_callback(proto.tasks.discard)

        def lost() -> None:
            if not task.done():
                task.cancel()  # the runtime drops the request's queued inputs

        if not proto.watch.add(lost):
            task.cancel()
            return
        task.add_done_callback(lambda _t: proto.watch.discard(lost))

    async def _run(self, proto, cycle, path, native, texts, service, model) -> None:
        awaiting(cycle)  # this request's own task: what the runtime counts answered waits for the writing
        try:
            result, error = await settled(path, self.hot.embed(native, texts, service))
        except BaseException:  # cancelled: the connection was lost
            cycle.settle(CANCELLED)
            raise
        if error is not None:
            return _respond_with(proto, cycle, error)
        payload, version, extra = self.hot._payload(native, model, result)
        _respond(proto, cycle, 200, payload, version, extra)

    async def _predict(self, proto, cycle, single, texts, served) -> None:
        """TaskHotPathMiddleware's answer to a plain classify request (TEI's /predict)."""
        awaiting(cycle)
        try:
            result, error = await settled(_PREDICT, self.task.classify(served, texts))
        except BaseException:
            cycle.settle(CANCELLED)
            raise
        if error is not None:
            return _respond_with(proto, cycle, error)
        payload = predict_payload(single, result)
        _write(proto, cycle, 200, [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(payload)).encode())], payload)


def _respond_with(proto, cycle: HotCycle, response) -> None:
    """A Starlette response (the routes' error bodies) written as the ASGI path would write it."""
    _write(proto, cycle, response.status_code, response.raw_headers, response.body)


def _respond(proto, cycle: HotCycle, status: int, payload: bytes, version: str, extra) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"x-surge-model-version", version.encode()), *extra]
    _write(proto, cycle, status, headers, payload)


def _write(proto, cycle: HotCycle, status: int, headers, body: bytes) -> None:
    """Write the answer, end the response and count what it answers (the cycle's AtWrite): at once where the kernel
    took it all, else once the server's buffers drain; "cancelled" where the connection is lost or closing."""
    if cycle.disconnected or proto.transport.is_closing():
        cycle.settle(CANCELLED)
        return
    out = [STATUS_LINE[status]]
    for name, value in proto.server_state.default_headers:
        out += (name, b": ", value, b"\r\n")
    for name, value in headers:
        out += (name, b": ", value, b"\r\n")
    if not cycle.keep_alive:
        out.append(b"connection: close\r\n")
    out += (b"\r\n", body)
    proto.transport.write(b"".join(out))
    # As uvicorn's cycle ends a response: complete, close when not kept alive, then the protocol's
    # bookkeeping (the write goes out, the next pipelined request starts, keep-alive timer).
    cycle.response_complete = True
    if not cycle.keep_alive:
        proto.transport.close()
    proto.on_response_complete()  # flushed: what the kernel did not take waits in the transport
    cycle.written(proto.watch)


def find_direct(app) -> DirectRoutes | None:
    """The DirectRoutes of the FrontDoor under uvicorn's app wrappers, if it takes requests."""
    from surge.server.http.frontend import FrontDoor

    for _ in range(6):
        if isinstance(app, FrontDoor):
            return app.direct()
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None
