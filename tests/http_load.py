"""A lean closed-loop HTTP/1.1 load generator (keep-alive, asyncio streams).

Python HTTP clients (httpx, aiohttp) cost more CPU per request than a lean
server spends answering a cache hit; on a 2-core machine they, not the server,
would set the measured limit. This client writes pre-encoded requests and reads
responses by Content-Length: about as cheap as a Python client gets.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import orjson


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    bodies: list[tuple[int, bytes]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(q / 100 * len(s)))]


def encode_post(host: str, path: str, payload) -> bytes:
    body = orjson.dumps(payload)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    body = await reader.readexactly(length) if length else b""
    return status, body


async def closed_loop(url: str, requests: list[bytes] | None, clients: int, *, duration: float | None = None,
                      total: int | None = None, make=None, keep_bodies: bool = False) -> LoadResult:
    """`clients` connections, each sending its next request when the last is answered.

    Requests come from `requests` (cycled) or `make(i)`; stops after `total`
    requests or `duration` seconds.
    """
    u = urlparse(url)
    res = LoadResult()
    counter = iter(range(10**12))
    stop_at = time.perf_counter() + duration if duration else None

    async def one():
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        try:
            while True:
                i = next(counter)
                if total is not None and i >= total:
                    return
                if stop_at is not None and time.perf_counter() >= stop_at:
                    return
                req = make(i) if make else requests[i % len(requests)]
                t = time.perf_counter()
                writer.write(req)
                status, body = await _read_response(reader)
                res.latencies.append(time.perf_counter() - t)
                res.statuses[status] = res.statuses.get(status, 0) + 1
                if keep_bodies:
                    res.bodies.append((i, body))
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(clients)))
    res.seconds = time.perf_counter() - start
    return res
