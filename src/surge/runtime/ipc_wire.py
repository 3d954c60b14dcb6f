"""The wire format between front ends and the engine process (`--workers N`, runtime/ipc.py).

Every frame is a u32 body length, then the body, whose first byte is its kind. Requests and
results travel in bulk: a front end sends everything its event loop collected in one pass as
one SUBMITS frame, and the engine process answers everything one pass settled (typically one
engine batch) as one RESULTS frame per front end. A syscall and a frame per request cost
~15 us each in Python, more than the rest of the request's handling in the engine process
(measured: 55 us of engine-process CPU per request with a frame and a send per request).

Bodies (little-endian):
  SUBMITS  B kind=6, I count, then arrays: u64 ids[count], f64 deadlines[count] (time.monotonic,
           system-wide on Linux; < 0: none), i32 priorities[count], u32 models[count] (the
           CATALOG's slot; 0: the one model of single-model mode), u32 inputs[count],
           i32 lengths[sum inputs], i32 token ids[T], i8 type ids[T]
  RESULTS  B kind=7, I count, I dim, then u64 ids[count], u32 rows[count], u64 queue_ns[count],
           u64 infer_ns[count], u32 executions[count] (the engine batches each was the first caller of:
           KServe's execution_count), f32 vectors[sum rows, dim]
  CANCEL   B kind=2, Q id
  ERROR    B kind=4, Q id, d retry_after, H code length, code, message (utf-8)
  HELLO    B kind=5, then JSON (the engine's capabilities), sent by the engine on connect
  CATALOG  B kind=8, then JSON: the models a repository's engine process serves, by slot (sent on
           connect and after every change of its registry; --model-repository under --workers)
  CONTROL  B kind=9, Q id, then JSON {"op", "name", "version"}: a repository call from a front end
  REPLY    B kind=10, Q id, then JSON {"result"} or {"error": {"code", "message"}}
  RETURN   B kind=11, Q connection id: the engine process gives an HTTP connection that this front
           end handed over back to it (server/http/handoff.py), between two requests
  TOKENS   B kind=12, then SUBMITS' layout (priorities unused): requests for every token's last
           hidden state (TEI's /embed_all, runtime/token_states.py), one request a frame
  STATES   B kind=13, Q id, I inputs, I dim, then u32 rows[inputs], f32 states[sum rows, dim]: one
           TOKENS request's answer (its failure: an ERROR frame). One frame, bounded by the front
           end's and the engine process's --max-token-states-bytes check before any compute (32 MiB
           by default), rather than a shared-memory segment: nothing to free when a process dies
           mid-answer. It holds the connection's later frames back while it is sent
"""

from __future__ import annotations

import json
import struct

import numpy as np

from surge import errors as E
from surge.types import Encoded

CANCEL, ERROR, HELLO, SUBMITS, RESULTS, CATALOG, CONTROL, REPLY, RETURN = 2, 4, 5, 6, 7, 8, 9, 10, 11
TOKENS, STATES = 12, 13
LEN = struct.Struct("<I")
_CANCEL = struct.Struct("<BQ")
_ERROR = struct.Struct("<BQdH")
_COUNT = struct.Struct("<BI")
_RCOUNT = struct.Struct("<BII")
# One request's fixed fields: with count 1 the arrays above are one value each, in this order, so
# the lone request (the latency case) is packed and read by one struct call instead of ~6 numpy
# calls a side (same bytes: tests/unit/test_ipc.py).
_ONE_SUBMIT = struct.Struct("<BIQdiII")  # kind, count=1, id, deadline, priority, model, inputs
_ONE_RESULT = struct.Struct("<BIIQIQQI")  # kind, count=1, dim, id, rows, queue_ns, infer_ns, executions


def frame(body: bytes) -> bytes:
    return LEN.pack(len(body)) + body


def encode_submits(reqs: list[tuple], kind: int = SUBMITS) -> bytes:
    """One frame for many requests: (id, inputs, deadline, priority[, model slot]) each. `kind`: TOKENS
    for a request of hidden states (same layout)."""
    k = len(reqs)
    if k == 1:
        r = reqs[0]
        head = [_ONE_SUBMIT.pack(kind, 1, r[0], -1.0 if r[2] is None else r[2], r[3], r[4] if len(r) > 4 else 0,
                                 len(r[1]))]
    else:
        head = [_COUNT.pack(kind, k),
                np.fromiter((r[0] for r in reqs), np.uint64, k).tobytes(),
                np.fromiter((-1.0 if r[2] is None else r[2] for r in reqs), np.float64, k).tobytes(),
                np.fromiter((r[3] for r in reqs), np.int32, k).tobytes(),
                np.fromiter((r[4] if len(r) > 4 else 0 for r in reqs), np.uint32, k).tobytes(),
                np.fromiter((len(r[1]) for r in reqs), np.uint32, k).tobytes()]
    items = [e for r in reqs for e in r[1]]
    lengths = np.fromiter((len(e.ids) for e in items), np.int32, len(items))
    tok = np.concatenate([e.ids for e in items]).astype(np.int32, copy=False)
    types = np.concatenate([e.type_ids for e in items]).astype(np.int8, copy=False)
    return frame(b"".join((*head, lengths.tobytes(), tok.tobytes(), types.tobytes())))


def decode_submits(body: bytes) -> list[tuple[int, list[Encoded], float | None, int, int]]:
    """(id, inputs, deadline, priority, model slot) per request."""
    _, k = _COUNT.unpack_from(body)
    if k == 1:
        _, _, rid, dl, pr, md, c = _ONE_SUBMIT.unpack_from(body)
        ids, deadlines, prios, models, counts = [rid], [dl], [pr], [md], [c]
        off = _ONE_SUBMIT.size
    else:
        off = _COUNT.size
        ids = np.frombuffer(body, np.uint64, k, off).tolist()
        off += 8 * k
        deadlines = np.frombuffer(body, np.float64, k, off).tolist()
        off += 8 * k
        prios = np.frombuffer(body, np.int32, k, off).tolist()
        off += 4 * k
        models = np.frombuffer(body, np.uint32, k, off).tolist()
        off += 4 * k
        counts = np.frombuffer(body, np.uint32, k, off).tolist()
        off += 4 * k
    n = sum(counts)
    lens = np.frombuffer(body, np.int32, n, off).tolist()
    off += 4 * n
    t = sum(lens)
    # One conversion for every request's tokens; each input is a view into it.
    tok = np.frombuffer(body, np.int32, t, off).astype(np.int64)
    types = np.frombuffer(body, np.int8, t, off + 4 * t).astype(np.int64)
    out, at, item = [], 0, 0
    for rid, dl, pr, md, c in zip(ids, deadlines, prios, models, counts):
        items = []
        for ln in lens[item:item + c]:
            items.append(Encoded(tok[at:at + ln], types[at:at + ln]))
            at += ln
        item += c
        out.append((rid, items, None if dl < 0 else dl, pr, md))
    return out


def encode_results(res: list[tuple[int, np.ndarray, int, int, int]]) -> bytes:
    """One frame for many requests' rows: (id, rows [n, dim], queue_ns, infer_ns, executions) each."""
    k = len(res)
    dim = res[0][1].shape[1]
    if k == 1:
        rid, rows, q, i, ex = res[0]
        return frame(_ONE_RESULT.pack(RESULTS, 1, dim, rid, rows.shape[0], q, i, ex)
                     + rows.astype(np.float32, copy=False).tobytes())
    head = _RCOUNT.pack(RESULTS, k, dim)
    ids = np.fromiter((r[0] for r in res), np.uint64, k)
    rows = np.fromiter((r[1].shape[0] for r in res), np.uint32, k)
    q = np.fromiter((r[2] for r in res), np.uint64, k)
    i = np.fromiter((r[3] for r in res), np.uint64, k)
    ex = np.fromiter((r[4] for r in res), np.uint32, k)
    vec = np.concatenate([r[1] for r in res]).astype(np.float32, copy=False)
    return frame(b"".join((head, ids.tobytes(), rows.tobytes(), q.tobytes(), i.tobytes(), ex.tobytes(),
                           vec.tobytes())))


def decode_results(body: bytes) -> list[tuple[int, np.ndarray, int, int, int]]:
    _, k, dim = _RCOUNT.unpack_from(body)
    if k == 1:
        _, _, _, rid, n, q, i, ex = _ONE_RESULT.unpack_from(body)
        return [(rid, np.frombuffer(body, np.float32, n * dim, _ONE_RESULT.size).reshape(n, dim), q, i, ex)]
    off = _RCOUNT.size
    ids = np.frombuffer(body, np.uint64, k, off).tolist()
    rows = np.frombuffer(body, np.uint32, k, off + 8 * k).tolist()
    q = np.frombuffer(body, np.uint64, k, off + 12 * k).tolist()
    i = np.frombuffer(body, np.uint64, k, off + 20 * k).tolist()
    ex = np.frombuffer(body, np.uint32, k, off + 28 * k).tolist()
    off += 32 * k
    vec = np.frombuffer(body, np.float32, sum(rows) * dim, off).reshape(-1, dim)
    out, at = [], 0
    for rid, n, qn, inn, e in zip(ids, rows, q, i, ex):
        out.append((rid, vec[at:at + n], qn, inn, e))
        at += n
    return out


_STATES = struct.Struct("<BQII")


def encode_states(req_id: int, rows: list[np.ndarray]) -> bytes:
    """A TOKENS request's answer: each input's [n_tokens, dim] rows, copied once (into the frame)."""
    dim = rows[0].shape[1] if rows else 0
    counts = np.fromiter((r.shape[0] for r in rows), np.uint32, len(rows)).tobytes()
    parts = [memoryview(np.ascontiguousarray(r, dtype=np.float32)).cast("B") for r in rows]
    head = _STATES.pack(STATES, req_id, len(rows), dim)
    size = len(head) + len(counts) + sum(p.nbytes for p in parts)
    return b"".join((LEN.pack(size), head, counts, *parts))


def decode_states(body: bytes) -> tuple[int, list[np.ndarray]]:
    """(id, each input's rows): views into `body`."""
    _, rid, k, dim = _STATES.unpack_from(body)
    if k == 0:
        return rid, []
    counts = np.frombuffer(body, np.uint32, k, _STATES.size).tolist()
    off = _STATES.size + 4 * k
    states = np.frombuffer(body, np.float32, sum(counts) * dim, off).reshape(-1, dim)
    out, at = [], 0
    for n in counts:
        out.append(states[at:at + n])
        at += n
    return rid, out


def encode_cancel(req_id: int) -> bytes:
    return frame(_CANCEL.pack(CANCEL, req_id))


def decode_cancel(body: bytes) -> int:
    return _CANCEL.unpack_from(body)[1]


def encode_return(conn_id: int) -> bytes:
    return frame(_CANCEL.pack(RETURN, conn_id))  # the same layout as CANCEL: kind, Q id


def decode_return(body: bytes) -> int:
    return _CANCEL.unpack_from(body)[1]


def encode_error(req_id: int, exc: BaseException) -> bytes:
    if isinstance(exc, E.SurgeError):
        code, msg, retry = exc.code, exc.message, float(getattr(exc, "retry_after", None) or 0.0)
    else:
        code, msg, retry = "engine_error", f"{type(exc).__name__}: {exc}", 0.0
    c = code.encode()
    return frame(_ERROR.pack(ERROR, req_id, retry, len(c)) + c + msg.encode())


_BY_CODE: dict[str, type] = {}


def _error_class(code: str) -> type:
    if not _BY_CODE:
        for name in dir(E):
            cls = getattr(E, name)
            if isinstance(cls, type) and issubclass(cls, E.SurgeError):
                _BY_CODE.setdefault(getattr(cls, "code", ""), cls)
    return _BY_CODE.get(code, E.EngineError)


def error_id(body: bytes) -> int:
    return _ERROR.unpack_from(body)[1]


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


_IDJ = struct.Struct("<BQ")


def encode_json(kind: int, obj, req_id: int | None = None) -> bytes:
    """CATALOG (no id), CONTROL and REPLY (an id) frames: a JSON body."""
    head = bytes([kind]) if req_id is None else _IDJ.pack(kind, req_id)
    return frame(head + json.dumps(obj).encode())


def decode_json(body: bytes, with_id: bool):
    """(id, obj) for CONTROL / REPLY, obj for CATALOG."""
    if not with_id:
        return json.loads(body[1:])
    return _IDJ.unpack_from(body)[1], json.loads(body[_IDJ.size:])


def error_json(exc: BaseException) -> dict:
    if isinstance(exc, E.SurgeError):
        return {"code": exc.code, "message": exc.message, "param": getattr(exc, "param", None)}
    return {"code": "engine_error", "message": f"{type(exc).__name__}: {exc}"}


def error_from_json(err: dict) -> E.SurgeError:
    cls = _error_class(err.get("code", ""))
    try:
        return cls(err.get("message", ""), param=err.get("param"))
    except TypeError:
        return cls(err.get("message", ""))


class Frames:
    """Splits a byte stream into frame bodies (asyncio protocols get arbitrary chunks)."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out, at, n = [], 0, len(buf)
        while n - at >= 4:
            size = LEN.unpack_from(buf, at)[0]
            if n - at - 4 < size:
                break
            out.append(bytes(buf[at + 4:at + 4 + size]))
            at += 4 + size
        if at:
            del buf[:at]
        return out
