"""Raw TCP helpers of the tests that hold connections open against a real server (slow clients, the gRPC
and metrics ports' limits)."""

from __future__ import annotations

import socket


def connect(port: int, timeout: float) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def connect_reading_slowly(port: int, timeout: float, window: int = 4096) -> socket.socket:
    """A connection whose receive buffer (so its TCP window) is `window` bytes, set before connecting: a
    client that does not read holds up the server's sending after little more than its own send buffer."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window)
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    return s


def read_to_close(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
