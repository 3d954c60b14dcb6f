"""surge.bench.rawhttp against real servers (aiohttp.web over TCP, and a raw socket server for
framings aiohttp would not send), checked against aiohttp's own client on the same endpoints."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from aiohttp import web

from surge.bench.rawhttp import RawConnection


async def _echo(request: web.Request) -> web.Response:
    data = await request.json()
    return web.json_response({"got": data, "n": len(data["input"])}, headers={"X-Surge-Queue-Ms": "0.25"})


async def _chunked(request: web.Request) -> web.StreamResponse:
    data = await request.read()
    resp = web.StreamResponse(headers={"X-Parts": "3"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for i in range(3):  # three writes: three chunks, sent apart
        await resp.write(data[i::3])
        await asyncio.sleep(0.01)
    await resp.write_eof()
    return resp


async def _close(request: web.Request) -> web.Response:
    return web.Response(body=b"bye", headers={"Connection": "close"})


async def _empty(request: web.Request) -> web.Response:
    return web.Response(status=204)


async def _slow(request: web.Request) -> web.Response:
    data = await request.json()
    await asyncio.sleep(data["sleep"])
    return web.json_response({"answer": data["id"]})


async def _bad(request: web.Request) -> web.Response:
    return web.json_response({"error": "no"}, status=422)


@pytest.fixture
def server_port():
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/echo", _echo)
    app.router.add_post("/chunked", _chunked)
    app.router.add_post("/close", _close)
    app.router.add_post("/empty", _empty)
    app.router.add_post("/bad", _bad)
    app.router.add_post("/slow", _slow)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    yield loop, port
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_answers_match_aiohttp_on_one_keep_alive_connection(server_port):
    loop, port = server_port
    rng = random.Random(7)
    bodies = [json.dumps({"input": "".join(rng.choice("abcdé xyz") for _ in range(rng.randint(1, 3000)))}).encode()
              for _ in range(40)]

    async def main():
        conn = RawConnection("127.0.0.1", port, want=("x-surge-queue-ms", "x-parts"))
        raw = []
        for b in bodies:
            raw.append(await conn.request("/echo", b))
            raw.append(await conn.request("/chunked", b))
        first = conn._proto
        async with aiohttp.ClientSession() as s:
            ref = []
            for b in bodies:
                for path in ("/echo", "/chunked"):
                    async with s.post(f"http://127.0.0.1:{port}{path}", data=b,
                                      headers={"content-type": "application/json"}) as r:
                        ref.append((r.status, await r.read(), r.headers.get("X-Surge-Queue-Ms"), r.headers.get("X-Parts")))
        return raw, ref, first is conn._proto

    raw, ref, same_conn = loop.run_until_complete(main())
    assert same_conn  # keep-alive: every request on the first connection
    for r, (status, body, q, parts) in zip(raw, ref):
        assert r.status == status == 200
        assert r.body == body
        assert r.headers.get("x-surge-queue-ms") == q
        assert r.headers.get("x-parts") == parts
    # the chunked answer really was the body's three interleaved slices, in order
    b = bodies[0]
    assert raw[1].body == b[0::3] + b[1::3] + b[2::3] and raw[1].headers == {"x-parts": "3"}


def test_status_codes_empty_bodies_and_connection_close_reconnects(server_port):
    loop, port = server_port

    async def main():
        conn = RawConnection("127.0.0.1", port)
        bad = await conn.request("/bad", b"{}")
        empty = await conn.request("/empty", b"{}")
        first = conn._proto
        bye = await conn.request("/close", b"{}")
        after = await conn.request("/echo", b'{"input": "ok"}')  # a new connection
        return bad, empty, bye, after, first, conn._proto

    bad, empty, bye, after, first, last = loop.run_until_complete(main())
    assert (bad.status, json.loads(bad.body)) == (422, {"error": "no"})
    assert (empty.status, empty.body) == (204, b"")
    assert (bye.status, bye.body) == (200, b"bye")
    assert after.status == 200 and json.loads(after.body)["n"] == 2
    assert first.closed and last is not first


def test_a_close_delimited_or_cut_response_is_an_error_not_a_result():
    loop = asyncio.new_event_loop()

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        if mode["cut"]:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        else:
            writer.write(b"HTTP/1.0 200 OK\r\n\r\nuntil close")
        await writer.drain()
        writer.close()

    mode = {"cut": False}

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        out = []
        for cut in (False, True):
            mode["cut"] = cut
            conn = RawConnection("127.0.0.1", port)
            with pytest.raises(ConnectionError) as err:
                await asyncio.wait_for(conn.request("/x", b"{}"), 5)
            out.append(str(err.value))
            conn.close()
        srv.close()
        return out

    try:
        msgs = loop.run_until_complete(main())
    finally:
        loop.close()
    assert "Content-Length" in msgs[0] and "closed before the response ended" in msgs[1]


def test_a_timed_out_request_closes_its_connection_so_a_late_answer_is_never_read(server_port):
    loop, port = server_port

    async def main():
        conn = RawConnection("127.0.0.1", port)
        await conn.connect()
        first = conn._proto
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await conn.request("/slow", b'{"sleep": 0.5, "id": 1}', timeout=0.1)
        waited = loop.time() - t0
        closed = first.closed or first.transport.is_closing()
        # the next request: a new connection, and its own answer (not request 1's, sent 0.4 s later)
        nxt = await conn.request("/slow", b'{"sleep": 0.6, "id": 2}', timeout=5)
        return waited, closed, nxt, conn._proto is not first

    waited, closed, nxt, reconnected = loop.run_until_complete(main())
    # Timed out (not answered: the answer comes at 0.5 s), no sooner than asked; its connection closed.
    assert waited >= 0.1 and closed and reconnected
    assert nxt.status == 200 and json.loads(nxt.body) == {"answer": 2}
