"""The server behind `--metrics-port`: prometheus_client's WSGI app on a threaded server, as its own
`start_http_server`, with bounds on what a client can hold.

prometheus_client's server runs a thread per connection and never times a read: a client that sent
nothing, or half a request, held its thread (and descriptor) for ever, and enough of them used up the
process's threads or descriptors. Here:

- a deadline: a request must arrive whole within `read_timeout_s` of the connection's opening, else the
  connection is closed (a per-read timeout alone would let a client that sends a byte now and then hold it);
  answering it is timed the same way afresh, so that a client that does not read cannot hold it either;
- a connection limit: over `max_connections` open connections a new one gets 503 at once and is closed,
  without a thread.

One request per connection (HTTP/1.0, as wsgiref answers), which is how scrapers use it.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from surge.server.http.conn_guard import OVERLOADED

MAX_CONNECTIONS = 64  # scrapers are few; each connection is a thread


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each allowed only the time left before `deadline` (time.monotonic())."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own reader, replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + self.server.read_timeout_s))

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.connection.settimeout(self.server.read_timeout_s)  # the request is in: the answer's time starts
        return ok

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # TimeoutError included: too slow to send the request (or read the answer)
            self.close_connection = True

    def log_message(self, format, *args) -> None:
        """No access log (as prometheus_client's own handler)."""


class MetricsServer(ThreadingWSGIServer):
    read_timeout_s: float = 60.0
    max_connections: int = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._open = 0

    def process_request(self, request, client_address) -> None:
        with self._lock:
            admitted = self._open < self.max_connections
            self._open += admitted
        if not admitted:
            try:
                request.setblocking(False)  # the accepting thread never waits on a client
                request.send(OVERLOADED)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread for it
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._open -= 1


def start_metrics_server(port: int, addr: str, registry, read_timeout_s: float,
                         max_connections: int) -> tuple[MetricsServer, threading.Thread]:
    """Serve `registry` on addr:port from a daemon thread; stop with server.shutdown(), server_close()."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(MetricsServer):
        address_family = family

    Server.read_timeout_s = read_timeout_s
    Server.max_connections = max_connections
    server = Server((sockaddr[0], port), _Handler)
    server.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=server.serve_forever, name="surge-metrics", daemon=True)
    thread.start()
    return server, thread
