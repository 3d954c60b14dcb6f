"""What the kernel says of a served TCP connection, for the send deadlines of both ports (server/http/conn_guard.py,
server/grpc/send_deadline.py): how much of what was sent the client has acknowledged, and a reset."""

from __future__ import annotations

import contextlib
import socket
import struct
import sys

_TCP_INFO = getattr(socket, "TCP_INFO", None)
_BYTES_ACKED = slice(120, 128)  # struct tcp_info's u64 tcpi_bytes_acked (linux/tcp.h, since 4.1)


def bytes_acked(sock) -> int | None:
    """How many bytes sent on the connection the client has acknowledged: it acknowledges what it reads as it
    reads it, where the sender's own buffers report room only once a third or so of them has drained (None
    where the system does not say). `sock`: a socket, or an event loop transport's socket object."""
    if _TCP_INFO is None or sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
    except OSError:
        return None
    return int.from_bytes(info[_BYTES_ACKED], sys.byteorder) if len(info) >= _BYTES_ACKED.stop else None


def drop_on_close(sock) -> None:
    """SO_LINGER 0 (nginx's reset_timedout_connection): closing the connection resets it, and the kernel drops
    what it still holds for a client that does not read instead of keeping it in FIN_WAIT1."""
    if sock is not None:
        with contextlib.suppress(OSError):  # closed meanwhile: nothing left to drop
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
