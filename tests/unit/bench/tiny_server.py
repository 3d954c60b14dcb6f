"""A tiny real HTTP/1.1 server (asyncio streams, keep-alive) for load-generator tests.

It runs in a background thread with its own event loop and answers every
request through `behave(index, path, body) -> (status, body) | "close"`, so a
test can inject 500s, 429s, dropped connections or wrong answers, and know
exactly how many of each it sent. `service_s` > 0 with `serial=True` makes it a
single-server queue (one request at a time, fixed service time).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time


def embed_ok(index: int, path: str, body: bytes):
    n = len(json.loads(body)["inputs"])
    return 200, json.dumps({"embeddings": [[0.25, 0.5]] * n}).encode()


class TinyServer:
    def __init__(self, behave=embed_ok, service_s: float = 0.0, serial: bool = False, ssl=None):
        self.behave = behave
        self.ssl = ssl  # an ssl.SSLContext: HTTPS
        self.connections = 0  # TCP connections accepted
        self.ended = 0  # connections whose client closed them (or that ended here)
        self.paths: list[str] = []
        self.service_s = service_s
        self.serial = serial
        self.count = 0
        self.arrivals: list[float] = []  # perf_counter when each request was read
        self.inflight = 0
        self.max_inflight = 0
        self.statuses: dict = {}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl else 'http'}://127.0.0.1:{self.port}"

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._lock = asyncio.Lock()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port,
                                                                                  ssl=self.ssl))
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                line0 = head.split(b"\r\n", 1)[0].decode()
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                index = self.count
                self.paths.append(line0.split(" ")[1])
                self.count += 1
                self.arrivals.append(time.perf_counter())
                self.inflight += 1
                self.max_inflight = max(self.max_inflight, self.inflight)
                try:
                    if self.service_s:
                        if self.serial:
                            async with self._lock:
                                await asyncio.sleep(self.service_s)
                        else:
                            await asyncio.sleep(self.service_s)
                    answer = self.behave(index, line0.split(" ")[1], body)
                finally:
                    self.inflight -= 1
                if answer == "close":
                    self.statuses["close"] = self.statuses.get("close", 0) + 1
                    writer.transport.abort()
                    return
                status, payload = answer
                self.statuses[status] = self.statuses.get(status, 0) + 1
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(payload), payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.ended += 1
            writer.close()

    def __enter__(self):
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        async def stop():
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
