"""A KServe infer request caught by a reload, on a real server: the route looks the model up, then waits for a
chunked body while `POST /models/{name}/reload` retires the copy it looked up."""

from __future__ import annotations

import socket

import httpx
import orjson


def infer_across_a_reload(server, model: str, text: str) -> bytes:
    """The raw HTTP reply (status line, headers, body) to a one-text KServe infer sent around a reload."""
    body = orjson.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]})
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall((f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\n"
                      "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        sock.sendall(b"%x\r\n%s\r\n" % (10, body[:10]))
        assert httpx.post(server.url + f"/models/{model}/reload", timeout=120).status_code == 200
        rest = body[10:]
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return reply
