"""Token batches between front-end processes and an engine process (`--workers N`).

Front ends parse, validate, look up the cache and tokenize; they send each
request's token ids here and get pooled vectors back. The engine process
runs the continuous batcher over every front end's requests, so batches are
as full as in one process.

Why this IPC: one Unix-domain stream socket per front end, frames of a fixed
struct header plus raw numpy bytes (int32 ids, float32 rows). A request is a
few hundred bytes and its answer 1.5 KB (MiniLM), so copying costs far less
than the ~20 us syscall pair per message; shared-memory rings would save the
copy but need their own wake-up channel (a socket or futex) anyway, and
ZeroMQ + msgspec would add two dependencies for the same framing. asyncio
streams give back-pressure and EOF detection (a dead peer is noticed at once,
so in-flight requests fail with 503 instead of hanging).

Frames (little-endian), after a u32 body length:
  SUBMIT  B kind=1, Q id, d deadline (time.monotonic, system-wide on Linux), i priority, I n,
          then int32 lengths[n], int32 ids[T], int8 type_ids[T]
  CANCEL  B kind=2, Q id
  RESULT  B kind=3, Q id, I rows, I dim, Q queue_ns, Q infer_ns, then float32 [rows, dim]
  ERROR   B kind=4, Q id, d retry_after, H code length, code, message (utf-8)
  HELLO   B kind=5, then JSON (the engine's capabilities), sent by the engine on connect
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import struct

import numpy as np

from surge import errors as E
from surge.types import Encoded

log = logging.getLogger("surge.ipc")

SUBMIT, CANCEL, RESULT, ERROR, HELLO = 1, 2, 3, 4, 5
_LEN = struct.Struct("<I")
_SUBMIT = struct.Struct("<BQdiI")
_CANCEL = struct.Struct("<BQ")
_RESULT = struct.Struct("<BQIIQQ")
_ERROR = struct.Struct("<BQdH")


def _frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    n = _LEN.unpack(await reader.readexactly(4))[0]
    return await reader.readexactly(n)


def encode_submit(req_id: int, items: list[Encoded], deadline: float | None, priority: int) -> bytes:
    lengths = np.fromiter((len(e) for e in items), np.int32, len(items))
    ids = np.concatenate([e.ids for e in items]).astype(np.int32, copy=False)
    types = np.concatenate([e.type_ids for e in items]).astype(np.int8, copy=False)
    head = _SUBMIT.pack(SUBMIT, req_id, -1.0 if deadline is None else deadline, priority, len(items))
    return _frame(head + lengths.tobytes() + ids.tobytes() + types.tobytes())


def decode_submit(body: bytes) -> tuple[int, list[Encoded], float | None, int]:
    _, req_id, deadline, priority, n = _SUBMIT.unpack_from(body)
    off = _SUBMIT.size
    lengths = np.frombuffer(body, np.int32, n, off)
    off += 4 * n
    t = int(lengths.sum())
    ids = np.frombuffer(body, np.int32, t, off).astype(np.int64)
    types = np.frombuffer(body, np.int8, t, off + 4 * t).astype(np.int64)
    items, at = [], 0
    for ln in lengths.tolist():
        items.append(Encoded(ids[at:at + ln], types[at:at + ln]))
        at += ln
    return req_id, items, (None if deadline < 0 else deadline), priority


def encode_result(req_id: int, rows: np.ndarray, timings: dict) -> bytes:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    head = _RESULT.pack(RESULT, req_id, rows.shape[0], rows.shape[1], timings.get("queue_ns", 0),
                        timings.get("compute_infer_ns", 0))
    return _frame(head + rows.tobytes())


def encode_error(req_id: int, exc: BaseException) -> bytes:
    if isinstance(exc, E.SurgeError):
        code, msg, retry = exc.code, exc.message, float(getattr(exc, "retry_after", None) or 0.0)
    else:
        code, msg, retry = "engine_error", f"{type(exc).__name__}: {exc}", 0.0
    c = code.encode()
    return _frame(_ERROR.pack(ERROR, req_id, retry, len(c)) + c + msg.encode())


_BY_CODE: dict[str, type] = {}


def _error_class(code: str) -> type:
    if not _BY_CODE:
        for name in dir(E):
            cls = getattr(E, name)
            if isinstance(cls, type) and issubclass(cls, E.SurgeError):
                _BY_CODE.setdefault(getattr(cls, "code", ""), cls)
    return _BY_CODE.get(code, E.EngineError)


def decode_error(body: bytes) -> E.SurgeError:
    _, _, retry, n = _ERROR.unpack_from(body)
    off = _ERROR.size
    code = body[off:off + n].decode()
    msg = body[off + n:].decode()
    cls = _error_class(code)
    try:
        exc = cls(msg, retry_after=retry) if retry else cls(msg)
    except TypeError:
        exc = cls(msg)
    return exc


class EngineClient:
    """A front end's side: the DynamicBatcher interface (`submit`, `close`) over the socket.

    If the engine process goes away, every request in flight fails at once with
    503 (NotReady), `on_state(False)` is called, and the client reconnects in
    the background (the supervisor restarts the engine); `on_state(True)` then.
    """

    def __init__(self, path: str, on_state=None, reconnect_s: float = 0.2):
        self.path = path
        self.on_state = on_state
        self.reconnect_s = reconnect_s
        self.hello: dict | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, dict | None]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._closed = False
        self.queue_depth = 0

    async def connect(self, timeout_s: float = 300.0) -> dict:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self.path)
                body = await read_frame(reader)
                break
            except (OSError, asyncio.IncompleteReadError):
                if loop.time() > end:
                    raise E.NotReady(f"engine process at {self.path} did not answer") from None
                await asyncio.sleep(self.reconnect_s)
        if body[0] != HELLO:
            raise E.EngineError("engine process sent no hello")
        self.hello = json.loads(body[1:])
        self._writer = writer
        self._reader_task = loop.create_task(self._read(reader))
        if self.on_state:
            self.on_state(True)
        return self.hello

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                body = await read_frame(reader)
                kind = body[0]
                if kind == RESULT:
                    _, rid, rows, dim, q_ns, i_ns = _RESULT.unpack_from(body)
                    entry = self._pending.pop(rid, None)
                    if entry is None or entry[0].done():
                        continue
                    fut, timings = entry
                    arr = np.frombuffer(body, np.float32, rows * dim, _RESULT.size).reshape(rows, dim)
                    if timings is not None:
                        timings["queue_ns"] = max(timings.get("queue_ns", 0), q_ns)
                        timings["compute_infer_ns"] = timings.get("compute_infer_ns", 0) + i_ns
                    fut.set_result(arr)
                elif kind == ERROR:
                    rid = _ERROR.unpack_from(body)[1]
                    entry = self._pending.pop(rid, None)
                    if entry is not None and not entry[0].done():
                        entry[0].set_exception(decode_error(body))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._lost()

    def _lost(self) -> None:
        self._writer = None
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
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

    async def submit(self, items: list[Encoded], deadline: float | None = None, priority: int = 0,
                     timings: dict | None = None) -> np.ndarray:
        if self._writer is None:
            raise E.NotReady("the engine process is not connected; retry", retry_after=1.0)
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, timings)
        self._writer.write(encode_submit(rid, items, deadline, priority))
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller went away (client gone, deadline): the engine drops its inputs before compute.
            if self._pending.pop(rid, None) is not None and self._writer is not None:
                self._writer.write(_frame(_CANCEL.pack(CANCEL, rid)))
            raise

    async def close(self) -> None:
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()


class SharedTier:
    """The hot-query cache tier every front end shares: pooled rows keyed by token ids, in the
    engine process (each front end's misses arrive here anyway, so a lookup costs no extra hop).

    Byte-bounded LRU. Keys are the exact token ids and type ids, so any text, option or front end
    that tokenizes to the same input shares the row; the engine process serves one model build,
    and a restarted engine starts empty (never stale). Rows are pooled and unnormalized: the
    front end applies the request's options (dimensions, normalize) after, as for computed rows.
    """

    def __init__(self, max_bytes: int, metrics=None):
        import collections

        self.max_bytes = max_bytes
        self.bytes = 0
        self._rows: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self.hits = self.misses = 0
        self._metric = metrics.tier("shared")[0] if metrics is not None else None

    @staticmethod
    def key(e: Encoded) -> bytes:
        return e.ids.tobytes() + b"|" + e.type_ids.tobytes()

    def get(self, key: bytes) -> np.ndarray | None:
        row = self._rows.get(key)
        if row is None:
            self.misses += 1
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        if self._metric is not None:
            self._metric.inc()
        return row

    def put(self, key: bytes, row: np.ndarray) -> None:
        if key in self._rows or row.nbytes + len(key) > self.max_bytes:
            return
        self._rows[key] = row
        self.bytes += row.nbytes + len(key)
        while self.bytes > self.max_bytes:
            k, r = self._rows.popitem(last=False)
            self.bytes -= r.nbytes + len(k)


class EngineServer:
    """The engine process's side: every connection's requests into one batcher."""

    def __init__(self, batcher, hello: dict, shared: SharedTier | None = None):
        self.batcher = batcher
        self.hello = hello
        self.shared = shared
        self.connections = 0

    async def _rows(self, items: list[Encoded], deadline, priority, timings: dict) -> np.ndarray:
        shared = self.shared
        if shared is None:
            return await self.batcher.submit(items, deadline, priority, timings)
        keys = [shared.key(e) for e in items]
        found = [shared.get(k) for k in keys]
        miss = [i for i, r in enumerate(found) if r is None]
        if miss:
            rows = await self.batcher.submit([items[i] for i in miss], deadline, priority, timings)
            for j, i in enumerate(miss):
                found[i] = rows[j]
                shared.put(keys[i], rows[j].copy())
        return np.stack(found)

    async def serve(self, path: str) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._conn, path)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        tasks: dict[int, asyncio.Task] = {}
        loop = asyncio.get_running_loop()
        writer.write(_frame(bytes([HELLO]) + json.dumps(self.hello).encode()))

        async def one(rid, items, deadline, priority):
            timings: dict = {}
            try:
                rows = await self._rows(items, deadline, priority, timings)
                out = encode_result(rid, rows, timings)
            except asyncio.CancelledError:
                return
            except Exception as exc:  # noqa: BLE001 - an error belongs to its own request
                out = encode_error(rid, exc)
            finally:
                tasks.pop(rid, None)
            if not writer.is_closing():
                writer.write(out)

        try:
            while True:
                body = await read_frame(reader)
                if body[0] == SUBMIT:
                    rid, items, deadline, priority = decode_submit(body)
                    tasks[rid] = loop.create_task(one(rid, items, deadline, priority))
                elif body[0] == CANCEL:
                    t = tasks.pop(_CANCEL.unpack_from(body)[1], None)
                    if t is not None:
                        t.cancel()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            # A front end that went away: its queued inputs are not computed.
            for t in list(tasks.values()):
                t.cancel()
            writer.close()
            self.connections -= 1
