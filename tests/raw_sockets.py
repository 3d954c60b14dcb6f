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
    out = bytearray()  # not bytes: `bytes += chunk` copies all so far, 6 s of a 9 MB answer come in 8 KiB chunks
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


def post_until_head(port: int, path: str, body: bytes, timeout: float,
                    headers: bytes = b"", window: int = 4096) -> tuple[socket.socket, bytes]:
    """POSTs JSON `body` to `path` (`headers`: more header lines, each ending in CRLF) on a socket with a small
    receive buffer (connect_reading_slowly, of `window` bytes) and reads only until the answer's head has come (the
    answer is being sent): (the socket, what came so far)."""
    s = connect_reading_slowly(port, timeout, window)
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
              f"content-length: {len(body)}\r\n".encode() + headers + b"\r\n" + body)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(1024)
        assert chunk, got
        got += chunk
    return s, got


def read_in_steps(s: socket.socket, body: bytes, length: int, pause_s: float, step: int = 256 * 1024) -> bytes:
    """`body` (what came of the answer so far) read on to `length` bytes, `step` bytes at a time with `pause_s`
    between: a client reading slowly but steadily."""
    import time

    got = bytearray(body)  # not bytes: see read_to_close
    while len(got) < length:
        want = min(step, length - len(got))
        while want > 0:
            chunk = s.recv(min(want, 65536))
            assert chunk, (len(got), length)
            got += chunk
            want -= len(chunk)
        time.sleep(pause_s)
    return bytes(got)


def held_by_kernels(mine: int, peer: int) -> int | None:
    """Bytes of what a server on this host sent on a connection that the two kernels hold: the server's socket's
    send queue (not yet acknowledged) and the client's receive queue (not yet read), from /proc/net/tcp (and tcp6).
    `mine`: the client's port, `peer`: the server's. None once the server's socket is gone (its connection reset)."""
    tx = rx = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            local, remote = int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)
            queued_tx, queued_rx = (int(x, 16) for x in fields[4].split(":"))
            if (local, remote) == (peer, mine):
                tx = queued_tx
            elif (local, remote) == (mine, peer):
                rx = queued_rx
    return None if tx is None else tx + (rx or 0)
