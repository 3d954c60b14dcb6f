"""Token batches between front-end processes and an engine process (`--workers N`).

Front ends parse, validate, look up the cache and tokenize; they send each
request's token ids here and get pooled vectors back. The engine process
runs the continuous batcher over every front end's requests, so batches are
as full as in one process.

Why this IPC: one Unix-domain stream socket per front end carrying frames of
fixed headers plus raw numpy arrays (runtime/ipc_wire.py), in bulk: what one
event-loop pass collected goes as one frame and one send. A request is a few
hundred bytes and its answer 1.5 KB (MiniLM), so copying costs far less than
the syscalls and the per-message Python work; shared-memory rings would save
the copy but need their own wake-up channel (a socket or futex) anyway, and
ZeroMQ + msgspec would add two dependencies for the same framing. Both ends
are asyncio Protocols (no stream readers, no task per request): the engine
process enqueues each request into the batcher with a done-callback. The
socket gives EOF detection: a dead peer is noticed at once, so in-flight
requests fail with 503 instead of hanging.

Measured with a stand-in engine on the 2-core machine (benchmarks/ipc_loop.py): a frame, a task
and a send per request cost the engine process 36-58 us of CPU per request, in bulk 25-26 us.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

import numpy as np

from surge import errors as E
from surge.runtime import ipc_wire as W
from surge.runtime.request import EXECUTIONS
from surge.types import Encoded

log = logging.getLogger("surge.ipc")


class _Outbox:
    """Frames and requests queued during one event-loop pass, written as one send after it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.frames: list[bytes] = []
        self.scheduled = False

    def _schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.flush)

    def add(self, frame: bytes) -> None:
        self.frames.append(frame)
        self._schedule()

    def write_now(self, frame: bytes) -> bool:
        """Send `frame` at once when nothing is queued before it (order kept); False: queue it.

        For a lone request, whose frame would otherwise wait for the end of the loop pass (~20-35 us
        on the H200 host: docs/benchmarks/serving_core.md, session 5); under load requests are not
        alone and go in bulk as before."""
        if self.scheduled or self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(frame)
        return True

    def encode(self) -> list[bytes]:  # subclasses add their bulk frame
        return []

    def flush(self) -> None:
        self.scheduled = False
        out = self.encode()
        if self.frames:
            out += self.frames
            self.frames = []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))


class _ClientBox(_Outbox):
    def __init__(self, loop):
        super().__init__(loop)
        self.submits: list = []

    def submit(self, req, alone: bool = False) -> None:
        if alone and self.write_now(W.encode_submits([req])):
            return
        self.submits.append(req)
        self._schedule()

    def encode(self) -> list[bytes]:
        if not self.submits:
            return []
        reqs, self.submits = self.submits, []
        return [W.encode_submits(reqs)]


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, client: "EngineClient", box: _ClientBox):
        self.client = client
        self.box = box
        self.frames = W.Frames()
        self.hello: asyncio.Future = box.loop.create_future()

    def connection_made(self, transport) -> None:
        self.box.transport = transport

    def data_received(self, data: bytes) -> None:
        pending = self.client._pending
        for body in self.frames.feed(data):
            kind = body[0]
            if kind == W.RESULTS:
                for rid, arr, q_ns, i_ns, ex in W.decode_results(body):
                    entry = pending.pop(rid, None)
                    if entry is None or entry[0].done():
                        continue
                    fut, timings = entry
                    if timings is not None:
                        if q_ns > timings.get("queue_ns", 0):
                            timings["queue_ns"] = q_ns
                        timings["compute_infer_ns"] = timings.get("compute_infer_ns", 0) + i_ns
                        timings[EXECUTIONS] = timings.get(EXECUTIONS, 0) + ex
                    fut.set_result(arr)
            elif kind == W.STATES:
                rid, rows = W.decode_states(body)
                entry = pending.pop(rid, None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(rows)
            elif kind == W.ERROR:
                entry = pending.pop(W.error_id(body), None)
                if entry is not None and not entry[0].done():
                    entry[0].set_exception(W.decode_error(body))
            elif kind == W.HELLO and not self.hello.done():
                self.hello.set_result(json.loads(body[1:]))
            elif kind == W.CATALOG:
                self.client._catalog(W.decode_json(body, with_id=False))
            elif kind == W.RETURN:
                if self.client.on_return is not None:
                    self.client.on_return(W.decode_return(body))
            elif kind == W.REPLY:
                rid, obj = W.decode_json(body, with_id=True)
                fut = self.client._controls.pop(rid, None)
                if fut is not None and not fut.done():
                    if "error" in obj:
                        fut.set_exception(W.error_from_json(obj["error"]))
                    else:
                        fut.set_result(obj.get("result"))

    def connection_lost(self, exc) -> None:
        self.box.transport = None
        if not self.hello.done():
            self.hello.set_exception(ConnectionError("engine process closed the connection"))
            return
        self.client._lost(self)


class EngineClient:
    """A front end's side: the DynamicBatcher interface (`submit`, `close`) over the socket.

    If the engine process goes away, every request in flight fails at once with
    503 (NotReady), `on_state(False)` is called, and the client reconnects in
    the background (the supervisor restarts the engine); `on_state(True)` then.
    """

    def __init__(self, path: str, on_state=None, reconnect_s: float = 0.2, on_catalog=None):
        """`on_catalog(dict)`: called with every CATALOG the engine process sends (a repository's
        models by slot, --model-repository under --workers); `catalog` keeps the last one."""
        self.path = path
        self.on_state = on_state
        self.on_catalog = on_catalog
        self.catalog: dict | None = None
        self.on_return = None  # (connection id) -> None: an HTTP connection handed back (server/http/handoff.py)
        self._controls: dict[int, asyncio.Future] = {}
        self.reconnect_s = reconnect_s
        self.hello: dict | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, dict | None]] = {}
        self._proto: _ClientProtocol | None = None
        self._closed = False
        self.queue_depth = 0

    async def connect(self, timeout_s: float = 300.0) -> dict:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            box = _ClientBox(loop)
            try:
                _, proto = await loop.create_unix_connection(lambda: _ClientProtocol(self, box), self.path)
                hello = await asyncio.wait_for(proto.hello, timeout=max(1.0, end - loop.time()))
                break
            except (OSError, ConnectionError, asyncio.TimeoutError):
                if loop.time() > end:
                    raise E.NotReady(f"engine process at {self.path} did not answer") from None
                await asyncio.sleep(self.reconnect_s)
        self.hello = hello
        self._proto = proto
        if self.on_state:
            self.on_state(True)
        return self.hello

    def _lost(self, proto: _ClientProtocol) -> None:
        if proto is not self._proto:
            return
        self._proto = None
        pending, self._pending = self._pending, {}
        controls, self._controls = self._controls, {}
        for fut in [f for f, _ in pending.values()] + list(controls.values()):
            if not fut.done():
                fut.set_exception(E.NotReady("the engine process went away; retry", retry_after=1.0))
        if self._closed:
            return
        log.warning("engine process connection lost; reconnecting")
        if self.on_state:
            self.on_state(False)
        asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        try:
            await self.connect(timeout_s=3600)
        except Exception as exc:  # noqa: BLE001
            log.error("engine process did not come back: %s", exc)

    def _catalog(self, catalog: dict) -> None:
        self.catalog = catalog
        if self.on_catalog is not None:
            self.on_catalog(catalog)

    def bound(self, slot: int, can_return_tokens: bool = False) -> "BoundClient":
        """This client's submit (and token_states) for one model of the catalog (its slot)."""
        return BoundClient(self, slot, can_return_tokens)

    async def control(self, op: str, **args):
        """A repository call (index, load, unload, reload) run by the engine process."""
        proto = self._proto
        if proto is None:
            raise E.NotReady("the engine process is not connected; retry", retry_after=1.0)
        rid = next(self._ids)
        fut = proto.box.loop.create_future()
        self._controls[rid] = fut
        proto.box.add(W.encode_json(W.CONTROL, {"op": op, **args}, rid))
        return await fut

    async def submit(self, items: list[Encoded], deadline: float | None = None, priority: int = 0,
                     timings: dict | None = None, model: int = 0) -> np.ndarray:
        return await self._call(timings, lambda proto, rid: proto.box.submit(
            (rid, items, deadline, priority, model), alone=len(self._pending) == 1))

    async def _call(self, timings: dict | None, send):
        """send(proto, rid) a request frame and await its answer; cancelled in the engine process (which then
        drops its inputs before compute) when the caller goes away (client gone, deadline)."""
        proto = self._proto
        if proto is None:
            raise E.NotReady("the engine process is not connected; retry", retry_after=1.0)
        rid = next(self._ids)
        fut = proto.box.loop.create_future()
        self._pending[rid] = (fut, timings)
        send(proto, rid)
        try:
            return await fut
        except asyncio.CancelledError:
            if self._pending.pop(rid, None) is not None and self._proto is proto:
                proto.box.add(W.encode_cancel(rid))
            raise

    @property
    def can_return_tokens(self) -> bool:
        """Whether the engine process's engines return the hidden state (its HELLO says): token_states."""
        return bool((self.hello or {}).get("tokens"))

    async def token_states(self, items: list[Encoded], deadline: float | None = None,
                           model: int = 0) -> list[np.ndarray]:
        """Each input's last hidden state, computed by the engine process (runtime/token_states.of_tokens:
        admitted there too); cancelled there when the caller goes away."""
        return await self._call(None, lambda proto, rid: proto.box.add(
            W.encode_submits([(rid, items, deadline, 0, model)], kind=W.TOKENS)))

    async def close(self) -> None:
        self._closed = True
        proto, self._proto = self._proto, None
        if proto is not None and proto.box.transport is not None:
            proto.box.flush()
            proto.box.transport.close()


class BoundClient:
    """The DynamicBatcher interface for one model (slot) of a shared EngineClient."""

    def __init__(self, client: EngineClient, slot: int, can_return_tokens: bool = False):
        """`can_return_tokens`: the CATALOG entry's "tokens" (the build's engines return the hidden state)."""
        self.client, self.slot = client, slot
        self.can_return_tokens = can_return_tokens
        self.queue_depth = 0

    async def submit(self, items: list[Encoded], deadline: float | None = None, priority: int = 0,
                     timings: dict | None = None) -> np.ndarray:
        return await self.client.submit(items, deadline, priority, timings, model=self.slot)

    async def token_states(self, items: list[Encoded], deadline: float | None = None) -> list[np.ndarray]:
        return await self.client.token_states(items, deadline, model=self.slot)

    async def close(self) -> None:
        pass  # the connection is the front end's, closed when it stops


class _ServerBox(_Outbox):
    def __init__(self, loop):
        super().__init__(loop)
        self.results: list = []

    def result(self, res, alone: bool = False) -> None:
        if alone and self.write_now(W.encode_results([res])):
            return
        self.results.append(res)
        self._schedule()

    def encode(self) -> list[bytes]:
        if not self.results:
            return []
        res, self.results = self.results, []
        return [W.encode_results(res)]


class _ServerProtocol(asyncio.Protocol):
    """One front end's connection: its requests into the batcher, its answers back in bulk."""

    def __init__(self, server: "EngineServer"):
        self.server = server
        self.box = _ServerBox(asyncio.get_running_loop())
        self.frames = W.Frames()
        self.futures: dict[int, asyncio.Future] = {}

    def connection_made(self, transport) -> None:
        self.box.transport = transport
        self.server.connections += 1
        self.server.boxes.add(self.box)
        self.peer_pid = _peer_pid(transport)
        if self.peer_pid:
            self.server.by_pid[self.peer_pid] = self
        transport.write(W.frame(bytes([W.HELLO]) + json.dumps(self.server.hello).encode()))
        if self.server.models is not None:
            transport.write(W.encode_json(W.CATALOG, self.server.models.catalog()))

    def data_received(self, data: bytes) -> None:
        for body in self.frames.feed(data):
            kind = body[0]
            if kind == W.SUBMITS:
                for rid, items, deadline, priority, model in W.decode_submits(body):
                    self._start(rid, items, deadline, priority, model)
            elif kind == W.TOKENS:
                for rid, items, deadline, _, model in W.decode_submits(body):
                    self._start_tokens(rid, items, deadline, model)
            elif kind == W.CONTROL:
                rid, obj = W.decode_json(body, with_id=True)
                task = asyncio.get_running_loop().create_task(self._control(rid, obj))
                self.server.tasks.add(task)
                task.add_done_callback(self.server.tasks.discard)
            elif kind == W.CANCEL:
                fut = self.futures.pop(W.decode_cancel(body), None)
                if fut is not None:
                    fut.cancel()

    async def _control(self, rid: int, obj: dict) -> None:
        try:
            reply = {"result": await self.server.control(obj)}
        except Exception as exc:  # noqa: BLE001 - the caller's answer, whatever failed
            reply = {"error": W.error_json(exc)}
        self.box.add(W.encode_json(W.REPLY, reply, rid))

    def _start(self, rid: int, items: list[Encoded], deadline, priority, model: int = 0) -> None:
        timings: dict = {}
        try:
            fut = self.server.enqueue(items, deadline, priority, timings, model)
        except Exception as exc:  # noqa: BLE001 - overload, expired: this request's own answer
            self.box.add(W.encode_error(rid, exc))
            return
        self.futures[rid] = fut
        self.server.inflight += 1
        fut.add_done_callback(lambda f: self._done(rid, timings, f))

    def _start_tokens(self, rid: int, items: list[Encoded], deadline, model: int) -> None:
        """A TOKENS request: run by the model's own service (admitted there), answered as one STATES frame."""
        from surge.runtime.token_states import of_tokens

        try:
            service = self.server.token_service(model)
        except Exception as exc:  # noqa: BLE001 - an unknown slot: this request's own answer
            self.box.add(W.encode_error(rid, exc))
            return
        task = asyncio.get_running_loop().create_task(of_tokens(service, items, deadline))
        self.futures[rid] = task  # a CANCEL, or this front end going away, cancels it
        self.server.inflight += 1
        task.add_done_callback(lambda t: self._tokens_done(rid, t))

    def _tokens_done(self, rid: int, task: asyncio.Task) -> None:
        self.server.inflight -= 1
        self.futures.pop(rid, None)
        if task.cancelled():
            return
        exc = task.exception()
        try:
            self.box.add(W.encode_error(rid, exc) if exc is not None else W.encode_states(rid, task.result()))
        except Exception as err:  # noqa: BLE001 - e.g. rows of another width: still an answer
            self.box.add(W.encode_error(rid, err))

    def _done(self, rid: int, timings: dict, fut: asyncio.Future) -> None:
        self.server.inflight -= 1
        self.futures.pop(rid, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.box.add(W.encode_error(rid, exc))
        else:
            self.box.result((rid, fut.result(), timings.get("queue_ns", 0), timings.get("compute_infer_ns", 0),
                             timings.get(EXECUTIONS, 0)), alone=not self.futures)

    def connection_lost(self, exc) -> None:
        # A front end that went away: its queued inputs are not computed.
        self.box.transport = None
        for fut in list(self.futures.values()):
            fut.cancel()
        self.futures.clear()
        self.server.connections -= 1
        self.server.boxes.discard(self.box)
        if self.server.by_pid.get(self.peer_pid) is self:
            del self.server.by_pid[self.peer_pid]


class EngineServer:
    """The engine process's side: every connection's requests into one batcher."""

    def __init__(self, batcher, hello: dict, models=None, service=None):
        """`models`: a repository's served models by slot (cli/workers_repo.ModelSlots: `batcher(slot)`,
        `service(slot)`, `catalog()`, `control(obj)`, and `on_change` to set); None: the one `batcher`, slot 0,
        and `service`, its ModelService (TOKENS requests: runtime/token_states.of_tokens)."""
        self.batcher = batcher
        self.service = service
        self.hello = hello
        self.models = models
        self.connections = 0
        self.inflight = 0  # front ends' requests in the batcher now
        self.boxes: set[_ServerBox] = set()
        self.by_pid: dict[int, _ServerProtocol] = {}  # front ends by process id (SO_PEERCRED)
        self.tasks: set[asyncio.Task] = set()
        if models is not None:
            models.on_change = self.broadcast_catalog

    def broadcast_catalog(self) -> None:
        """Every front end gets the new catalog (called on each change of the repository's registry)."""
        frame = W.encode_json(W.CATALOG, self.models.catalog())
        for box in list(self.boxes):
            box.add(frame)

    def return_connection(self, pid: int, conn_id: int) -> bool:
        """Tell front end `pid` to serve its handed-over connection `conn_id` again; False: it is gone."""
        proto = self.by_pid.get(pid)
        if proto is None or proto.box.transport is None:
            return False
        frame = W.encode_return(conn_id)
        if not proto.box.write_now(frame):
            proto.box.add(frame)
        return True

    async def control(self, obj: dict):
        if self.models is None:
            raise E.NotFound("this engine process serves one model: no repository calls")
        return await self.models.control(obj)

    def enqueue(self, items: list[Encoded], deadline, priority: int, timings: dict, model: int = 0):
        """The rows' future. No expiry timer per request: the front end enforces the deadline and
        cancels, and the batcher drops expired inputs when it forms a batch. (Repeats are answered
        before they get here, from the table every front end shares: runtime/shm_cache.py.)"""
        batcher = self.batcher if self.models is None else self.models.batcher(model)
        return batcher.enqueue(items, deadline, priority, timings, timer=False)

    def token_service(self, model: int = 0):
        """The service that answers a TOKENS request for `model` (a slot, or 0 in single-model mode)."""
        if self.models is not None:
            return self.models.service(model)
        if self.service is None:
            raise E.Unsupported("this engine process returns no per-token hidden states")
        return self.service

    async def serve(self, path: str) -> asyncio.AbstractServer:
        return await asyncio.get_running_loop().create_unix_server(lambda: _ServerProtocol(self), path)


def _peer_pid(transport) -> int:
    """The connected front end's process id (a Unix socket's SO_PEERCRED), 0 where unknown."""
    import socket
    import struct

    sock = transport.get_extra_info("socket")
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except (AttributeError, OSError):
        return 0
