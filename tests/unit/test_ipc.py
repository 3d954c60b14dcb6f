"""runtime/ipc.py without processes: the wire format round-trips and errors keep their type."""

from __future__ import annotations

import numpy as np

from surge.errors import Overloaded
from surge.runtime import ipc_wire as W


def test_bulk_frames_round_trip_and_split_anywhere(bundled_worker, sentences):
    """Many requests in one SUBMITS frame and many answers in one RESULTS frame come back intact,
    however the byte stream is cut (a protocol gets arbitrary chunks)."""
    rng = np.random.default_rng()
    reqs = []
    for rid in rng.choice(1 << 40, 7, replace=False).tolist():
        texts = [sentences[i] for i in rng.choice(len(sentences), int(rng.integers(1, 4)), replace=False)]
        reqs.append((rid, bundled_worker.tokenizer.encode(texts), float(rng.uniform(0, 1e6)) if rid % 2 else None,
                     int(rng.integers(-3, 3)), int(rng.integers(0, 1 << 32))))
    dim = 24
    res = [(r[0], rng.standard_normal((len(r[1]), dim)).astype(np.float32), int(rng.integers(0, 1 << 40)),
            int(rng.integers(0, 1 << 40)), int(rng.integers(0, 1 << 32))) for r in reqs]
    stream = W.encode_submits(reqs) + W.encode_cancel(99) + W.encode_results(res) + W.encode_error(
        7, Overloaded("queue full", retry_after=2.0))
    cuts = sorted(rng.choice(len(stream), 5, replace=False).tolist())
    frames, parts = W.Frames(), []
    for a, b in zip([0] + cuts, cuts + [len(stream)]):
        parts += frames.feed(stream[a:b])
    assert [p[0] for p in parts] == [W.SUBMITS, W.CANCEL, W.RESULTS, W.ERROR]
    got = W.decode_submits(parts[0])
    assert len(got) == len(reqs)
    for (rid, items, dl, pr, md), (rid2, items2, dl2, pr2, md2) in zip(reqs, got):
        assert (rid, dl, pr, md) == (rid2, dl2, pr2, md2) and len(items) == len(items2)
        for a, b in zip(items, items2):
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_array_equal(a.type_ids, b.type_ids)
    assert W.decode_cancel(parts[1]) == 99
    for (rid, rows, q, i, ex), (rid2, rows2, q2, i2, ex2) in zip(res, W.decode_results(parts[2])):
        assert (rid, q, i, ex) == (rid2, q2, i2, ex2)
        np.testing.assert_array_equal(rows, rows2)
    err = W.decode_error(parts[3])
    assert W.error_id(parts[3]) == 7
    assert isinstance(err, Overloaded) and err.retry_after == 2.0 and err.http_status == 429


def _layout_submits(reqs) -> bytes:
    """The SUBMITS body exactly as ipc_wire's docstring lays it out (columns of every request)."""
    items = [e for r in reqs for e in r[1]]
    cols = [np.array([r[0] for r in reqs], "<u8"), np.array([-1.0 if r[2] is None else r[2] for r in reqs], "<f8"),
            np.array([r[3] for r in reqs], "<i4"), np.array([r[4] for r in reqs], "<u4"),
            np.array([len(r[1]) for r in reqs], "<u4"), np.array([len(e.ids) for e in items], "<i4"),
            np.concatenate([e.ids for e in items]).astype("<i4"), np.concatenate([e.type_ids for e in items]).astype("i1")]
    return bytes([W.SUBMITS]) + len(reqs).to_bytes(4, "little") + b"".join(c.tobytes() for c in cols)


def _layout_results(res) -> bytes:
    dim = res[0][1].shape[1]
    cols = [np.array([r[0] for r in res], "<u8"), np.array([r[1].shape[0] for r in res], "<u4"),
            np.array([r[2] for r in res], "<u8"), np.array([r[3] for r in res], "<u8"),
            np.array([r[4] for r in res], "<u4"), np.concatenate([r[1] for r in res]).astype("<f4")]
    return (bytes([W.RESULTS]) + len(res).to_bytes(4, "little") + dim.to_bytes(4, "little")
            + b"".join(c.tobytes() for c in cols))


def test_one_request_frames_have_the_documented_layout_and_round_trip(bundled_worker, sentences):
    """A lone request (one or several inputs) and a lone answer take the one-struct path; their bytes are
    the documented columns of count 1, as a bulk frame's are of count k, and they decode back."""
    rng = np.random.default_rng()
    for n_reqs in (1, 1, 2, 3):
        for n_inputs in (1, 3):
            reqs = []
            for _ in range(n_reqs):
                texts = [sentences[i] for i in rng.choice(len(sentences), n_inputs, replace=False)]
                reqs.append((int(rng.integers(0, 1 << 62)), bundled_worker.tokenizer.encode(texts),
                             None if rng.random() < 0.5 else float(rng.uniform(0, 1e6)), int(rng.integers(-3, 3)),
                             int(rng.integers(0, 1 << 32))))
            body = W.encode_submits(reqs)[4:]
            assert body == _layout_submits(reqs)
            for (rid, items, dl, pr, md), (rid2, items2, dl2, pr2, md2) in zip(reqs, W.decode_submits(body)):
                assert (rid, dl, pr, md) == (rid2, dl2, pr2, md2) and len(items2) == n_inputs
                for a, b in zip(items, items2):
                    np.testing.assert_array_equal(a.ids, b.ids)
                    np.testing.assert_array_equal(a.type_ids, b.type_ids)
                    assert b.ids.dtype == np.int64 and b.type_ids.dtype == np.int64
            res = [(r[0], rng.standard_normal((n_inputs, 384)).astype(np.float32), int(rng.integers(0, 1 << 40)),
                    int(rng.integers(0, 1 << 40)), int(rng.integers(0, 1 << 32))) for r in reqs]
            body = W.encode_results(res)[4:]
            assert body == _layout_results(res)
            for (rid, rows, q, i, ex), (rid2, rows2, q2, i2, ex2) in zip(res, W.decode_results(body)):
                assert (rid, q, i, ex) == (rid2, q2, i2, ex2)
                np.testing.assert_array_equal(rows, rows2)


def test_a_lone_request_is_sent_at_once_and_requests_in_flight_together_in_one_frame():
    """The front end's box on a real socket: a lone request's frame is on the wire before the loop
    turns; while others are queued in the pass, requests wait for the pass's one bulk frame (order kept)."""
    import asyncio
    import socket

    from surge.runtime.ipc import _ClientBox
    from surge.types import Encoded

    def item(k):
        return [Encoded(np.arange(100 + k, 110 + k, dtype=np.int64), np.zeros(10, np.int64))]

    async def main():
        a, b = socket.socketpair()
        b.setblocking(False)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=a)
        box = _ClientBox(loop)
        box.transport = transport

        def read() -> list:
            try:
                data = b.recv(1 << 20)
            except BlockingIOError:
                return []
            return [W.decode_submits(body) for body in W.Frames().feed(data)]

        box.submit((1, item(1), None, 0, 0), alone=True)
        got = read()  # no await: already sent
        assert len(got) == 1 and got[0][0][0] == 1
        box.submit((2, item(2), None, 0, 0), alone=False)
        box.submit((3, item(3), None, 0, 0), alone=True)  # something is queued before it: it waits
        assert read() == []
        await asyncio.sleep(0)  # the pass ends: one frame with both, in order
        got = read()
        assert len(got) == 1 and [r[0] for r in got[0]] == [2, 3]
        np.testing.assert_array_equal(got[0][1][1][0].ids, item(3)[0].ids)
        transport.close()
        b.close()

    asyncio.run(main())


def test_a_return_frame_reaches_the_front_end_by_its_process_id(tmp_path):
    """EngineServer.return_connection finds the connected front end by SO_PEERCRED and its
    EngineClient gets the connection id; an unknown process gets False (nothing sent)."""
    import asyncio
    import os

    from surge.runtime.ipc import EngineClient, EngineServer

    async def main():
        server = EngineServer(batcher=None, hello={"max_batch": 1})
        path = str(tmp_path / "e.sock")
        srv = await server.serve(path)
        client = EngineClient(path)
        got: list[int] = []
        client.on_return = got.append
        await client.connect(timeout_s=10)
        await _eventually(lambda: os.getpid() in server.by_pid)
        assert list(server.by_pid) == [os.getpid()]  # this process is the client here
        cid = int(np.random.default_rng().integers(1, 1 << 62))
        assert server.return_connection(os.getpid(), cid)
        assert not server.return_connection(os.getpid() + 10_000_000, 1)
        await _eventually(lambda: got)
        assert got == [cid]
        await client.close()
        await _eventually(lambda: not server.by_pid)
        assert server.by_pid == {}  # a front end that went away is forgotten
        srv.close()

    asyncio.run(main())


async def _eventually(cond, timeout_s: float = 30.0) -> None:
    """Until cond() holds; the test's own assert after it says what did not (no speed assumed)."""
    import asyncio
    import time

    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        await asyncio.sleep(0.01)


def test_token_state_frames_round_trip_and_split_anywhere(bundled_worker, sentences):
    """A TOKENS request (SUBMITS' layout under its own kind) and its STATES answer (each input's rows, of
    any count, an empty answer too) come back intact however the byte stream is cut."""
    rng = np.random.default_rng()
    items = bundled_worker.tokenizer.encode(sentences[:3])
    rows = [rng.standard_normal((len(e), 24)).astype(np.float32) for e in items]
    stream = (W.encode_submits([(5, items, 12.5, 0, 77)], kind=W.TOKENS) + W.encode_states(5, rows)
              + W.encode_states(6, []))
    cuts = sorted(rng.choice(len(stream), 6, replace=False).tolist())
    frames, parts = W.Frames(), []
    for a, b in zip([0] + cuts, cuts + [len(stream)]):
        parts += frames.feed(stream[a:b])
    assert [p[0] for p in parts] == [W.TOKENS, W.STATES, W.STATES]
    ((rid, got_items, deadline, _, model),) = W.decode_submits(parts[0])
    assert (rid, deadline, model) == (5, 12.5, 77)
    for a, b in zip(items, got_items):
        np.testing.assert_array_equal(a.ids, b.ids)
    rid, got = W.decode_states(parts[1])
    assert rid == 5 and len(got) == len(rows)
    for a, b in zip(rows, got):
        np.testing.assert_array_equal(a, b)
    assert W.decode_states(parts[2]) == (6, [])
