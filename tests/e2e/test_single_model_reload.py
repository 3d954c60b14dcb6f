"""Reloading the one model of `surge serve MODEL_DIR` under load drops nothing
(issue 16): 40 real keep-alive clients (HTTP and gRPC) send requests that miss
the cache while the model is reloaded over and over; every answer is a 200 and
equals the same input computed alone. A request that looked the model up
before a reload and calls it after (its body still arriving) is answered by
the new copy."""

from __future__ import annotations

import asyncio
import socket

import grpc
import httpx
import numpy as np
import orjson
import pytest

from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from surge.types import EmbedOptions
from tests.http_load import _read_response, encode_post
from tests.server_process import ServerProcess

MODEL = "all-MiniLM-L6-v2"
RELOADS = 4
CLIENTS = 40


@pytest.fixture(scope="module")
def srv():
    with ServerProcess("--threads", "1", "--cache-bytes", "0", grpc=True) as s:
        yield s


def test_a_request_whose_body_arrives_after_a_reload_is_answered(srv):
    body = orjson.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["late"]}]})
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as sock:
        # Chunked, so the route looks the model up and then waits for the body.
        sock.sendall((f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\n"
                      "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        sock.sendall(b"%x\r\n%s\r\n" % (10, body[:10]))
        r = httpx.post(srv.url + f"/models/{MODEL}/reload", timeout=120)
        assert r.status_code == 200, r.text
        rest = body[10:]
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


def test_reloads_under_load_answer_every_request(srv, sentences, bundled_worker):
    texts = [" ".join(s.split()[:6]) for s in sentences[:50]]
    w = bundled_worker
    alone = {t: w.finish(w.compute(w.tokenizer.encode([t])), EmbedOptions())[0] for t in texts}
    statuses: dict[object, int] = {}
    worst = 0.0
    done = asyncio.Event()

    def check(text: str, got) -> None:
        nonlocal worst
        worst = max(worst, float(np.abs(np.asarray(got, dtype=np.float32) - alone[text]).max()))

    async def http_client(k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        i = 0
        try:
            while not done.is_set():
                text = texts[(k * 7 + i) % len(texts)]
                path, key = ("/embed", "inputs") if i % 2 else ("/v1/embeddings", "input")
                writer.write(encode_post("127.0.0.1", path, {key: [text]}))
                status, body = await _read_response(reader)
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    data = orjson.loads(body)
                    check(text, data["embeddings"][0] if key == "inputs" else data["data"][0]["embedding"])
                i += 1
        finally:
            writer.close()

    async def grpc_client(k: int) -> None:
        async with grpc.aio.insecure_channel(srv.grpc_url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            i = 0
            while not done.is_set():
                text = texts[(k * 11 + i) % len(texts)]
                req = pb.ModelInferRequest(model_name=MODEL)
                req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
                    text.encode())
                try:
                    res = await stub.ModelInfer(req, timeout=60)
                    statuses[200] = statuses.get(200, 0) + 1
                    check(text, np.frombuffer(res.raw_output_contents[0], dtype="<f4"))
                except grpc.aio.AioRpcError as exc:
                    statuses[exc.code()] = statuses.get(exc.code(), 0) + 1
                i += 1

    async def reloader() -> list[int]:
        codes = []
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            await asyncio.sleep(0.5)  # the clients are sending
            for n in range(RELOADS):
                # Both routes of a single-model server reload it: native and KServe.
                path = f"/models/{MODEL}/reload" if n % 2 else f"/v2/repository/models/{MODEL}/load"
                codes.append((await c.post(path)).status_code)
                await asyncio.sleep(0.2)
        done.set()
        return codes

    async def main():
        clients = [http_client(k) for k in range(CLIENTS - 8)] + [grpc_client(k) for k in range(8)]
        results = await asyncio.gather(reloader(), *clients)
        return results[0]

    codes = asyncio.run(main())
    assert codes == [200] * RELOADS, codes
    assert set(statuses) == {200}, statuses
    assert statuses[200] > 10 * CLIENTS, statuses  # the reloads happened under traffic
    assert worst < 1e-4, worst
    assert srv.alive()
