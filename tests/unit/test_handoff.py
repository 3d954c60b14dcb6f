"""server/http/handoff.py on real sockets: the slot count, a hand-over that loses no byte the client
sent before it, the fallback when no engine process listens, and 503 on the held duplicates."""

from __future__ import annotations

import asyncio

import pytest

from surge.server.http.handoff import UNAVAILABLE, Handoff, Intake, Slots


def test_slots_count_across_handles_up_to_the_limit(tmp_path):
    path = str(tmp_path / "e.sock.http")
    a, b = Slots(path), Slots(path)  # as two processes would
    a.reset()
    assert a.take(2) and b.take(2)
    assert not a.take(2) and not b.take(2)
    assert a.count() == b.count() == 2
    b.give()
    assert a.count() == 1 and a.take(2)
    a.reset()
    assert b.count() == 0
    b.give()  # never below zero
    assert a.count() == 0


class _Echo(asyncio.Protocol):
    """What the engine process's HTTP protocol stands for here: records what it reads."""

    def __init__(self, handed, got: list):
        self.handed, self.got, self.buf = handed, got, b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        if b"\n" in data:
            self.got.append(self.buf)
            self.transport.write(b"answer:" + self.buf)
            self.transport.close()

    def connection_lost(self, exc):
        self.handed.closed()


class _Accepting(asyncio.Protocol):
    """A front end's protocol: offers the connection at connection_made, else keeps it."""

    def __init__(self, handoff, kept: list):
        self.handoff, self.kept = handoff, kept

    def connection_made(self, transport):
        if not self.handoff.offer(transport):
            self.kept.append(transport)


async def _pair(tmp_path, limit=1):
    engine_sock = str(tmp_path / "engine0.sock")
    got: list[bytes] = []
    intake = Intake(engine_sock, lambda handed: _Echo(handed, got))
    intake.start()
    handoff = Handoff(engine_sock, limit, reap_s=0.05)
    handoff.engine_back()
    kept: list = []
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Accepting(handoff, kept), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return intake, handoff, server, port, got, kept


async def _roundtrip(port: int, first: bytes, rest: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first)  # sent at once: it may already be queued when the front end hands over
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(rest)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    return data


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_handed_connection_is_served_by_the_intake_with_every_byte(tmp_path, loop_kind):
    async def main():
        intake, handoff, server, port, got, kept = await _pair(tmp_path)
        data = await _roundtrip(port, b"hello ", b"there\n")
        assert data == b"answer:hello there\n"
        assert intake.served == 1 and kept == [] and handoff.handed == 1
        # the intake gave its slot back; the front end closes its duplicate
        await _eventually(lambda: not handoff.held and intake.slots.count() == 0)
        assert intake.slots.count() == 0 and not handoff.held
        # a second one, after the first closed, goes to the engine process again
        assert await _roundtrip(port, b"again", b"\n") == b"answer:again\n"
        assert intake.served == 2
        server.close()
        intake.stop()
        handoff.close()

    _run(main(), loop_kind)


def test_beyond_the_limit_and_without_an_engine_the_front_end_keeps_the_connection(tmp_path):
    async def main():
        intake, handoff, server, port, got, kept = await _pair(tmp_path, limit=1)
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)  # takes the one slot
        await _eventually(lambda: intake.open == 1)
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)  # over the limit: stays
        await _eventually(lambda: kept)
        assert len(kept) == 1 and intake.served == 1
        assert intake.slots.count() == 1
        w1.close()
        w2.close()
        await _eventually(lambda: intake.slots.count() == 0)
        intake.stop()  # no engine process listening now
        r3, w3 = await asyncio.open_connection("127.0.0.1", port)
        await _eventually(lambda: len(kept) == 2)
        assert len(kept) == 2 and not kept[1].is_closing()  # kept and served here
        assert intake.slots.count() == 0  # the failed hand-over gave its slot back
        w3.close()
        server.close()
        handoff.close()

    _run(main(), "asyncio")


def test_when_the_engine_goes_away_held_connections_answer_503(tmp_path):
    async def main():
        engine_sock = str(tmp_path / "engine0.sock")
        # An intake that takes connections and never answers: the engine process hangs or dies.
        stuck: list = []
        intake = Intake(engine_sock, lambda handed: _Silent(stuck))
        intake.start()
        handoff = Handoff(engine_sock, 1)
        handoff.engine_back()
        kept: list = []
        server = await asyncio.get_running_loop().create_server(lambda: _Accepting(handoff, kept), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        await _eventually(lambda: stuck)
        assert stuck and handoff.held
        handoff.engine_lost()
        for t in stuck:  # what the kernel does to a dead process's descriptors
            t.abort()
        data = await asyncio.wait_for(reader.read(), 60)
        assert data == UNAVAILABLE
        head, body = data.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head
        assert b'"code":"not_ready"' in body and int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) == len(body)
        assert not handoff.offer(_FakeTransport())  # nothing is handed over until the engine is back
        server.close()
        intake.stop()
        handoff.close()

    _run(main(), "asyncio")


class _Silent(asyncio.Protocol):
    def __init__(self, stuck: list):
        self.stuck = stuck

    def connection_made(self, transport):
        self.stuck.append(transport)


class _FakeTransport:
    def get_extra_info(self, name):
        raise AssertionError("a disabled hand-off must not look at the connection")


def _run(coro, loop_kind: str):
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(coro)
    else:
        asyncio.run(coro)


class _Answering(asyncio.Protocol):
    """A protocol that answers each line; the engine side hands the connection back after its
    first answer (as HandedProtocol does when the engine process is busy)."""

    def __init__(self, tag: bytes, handed=None):
        self.tag, self.handed, self.buf = tag, handed, b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            self.transport.write(self.tag + line + b"\n")
            if self.handed is not None and not self.buf:
                self.transport.pause_reading()
                assert self.handed.hand_back()
                self.transport.abort()
                return

    def connection_lost(self, exc):
        if self.handed is not None:
            self.handed.closed()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_connection_handed_back_goes_on_at_the_front_end_without_losing_a_byte(tmp_path, loop_kind):
    async def main():
        loop = asyncio.get_running_loop()
        engine_sock = str(tmp_path / "engine0.sock")
        handoff = Handoff(engine_sock, 1, reap_s=0.05)
        # give_back stands for the RETURN frame (runtime/ipc.py, tested in e2e): delivered a pass later
        intake = Intake(engine_sock, lambda handed: _Answering(b"engine:", handed),
                        give_back=lambda pid, cid: loop.call_soon(handoff.take_back, cid) is not None)
        intake.start()
        handoff.engine_back()

        class Front(asyncio.Protocol):
            def connection_made(self, transport):
                handoff.offer(transport, lambda: _Answering(b"front:"))

        server = await loop.create_server(Front, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"one\n")
        assert await asyncio.wait_for(reader.readline(), 60) == b"engine:one\n"
        writer.write(b"two\n")  # may reach the socket before the front end takes it back: never lost
        assert await asyncio.wait_for(reader.readline(), 60) == b"front:two\n"
        writer.write(b"three\n")
        assert await asyncio.wait_for(reader.readline(), 60) == b"front:three\n"
        assert intake.returned == 1 and handoff.returned == 1 and not handoff.held
        assert intake.slots.count() == 0 and intake.open == 0  # the engine's slot is free again
        writer.close()
        server.close()
        intake.stop()
        handoff.close()

    _run(main(), loop_kind)


async def _eventually(cond, timeout_s: float = 30.0) -> None:
    """Until cond() holds; the test's own assert after it says what did not (no speed assumed)."""
    import asyncio
    import time

    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        await asyncio.sleep(0.01)
