"""The socket of a gRPC call's connection, found by the call's peer address (what the client has taken of what
was sent: server/tcp_info.py), and a reset. grpc.aio gives a servicer the peer ("ipv4:127.0.0.1:5555") and nothing else of the
connection, and no way to end a call whose answer grpc core is still writing (server/grpc/send_deadline.py); the
socket is the one handle left.

Only this process's descriptors are looked at (/proc/self/fd, or /dev/fd), each through a duplicate closed at once:
a duplicate kept would keep the connection open after grpc core has closed its own descriptor. A descriptor is
reused once closed, so one remembered is checked against the peer before each use. Linux gives the bytes acknowledged
(TCP_INFO's tcpi_bytes_acked, since 4.1); elsewhere they are unknown (None).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from urllib.parse import unquote

from surge.server.tcp_info import drop_on_close

Peer = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]

_FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


def peer_of(text: str) -> Peer | None:
    """A call's peer as grpc writes it ("ipv4:1.2.3.4:5", "ipv6:[::1]:5", maybe %-escaped); None for any other
    transport (a Unix socket)."""
    kind, _, rest = unquote(text).partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    try:
        return _plain(host.strip("[]")), int(port)
    except ValueError:
        return None


def _plain(host: str):
    """An address as one form for both stacks: a dual-stack socket names an IPv4 client ::ffff:1.2.3.4."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    return getattr(ip, "ipv4_mapped", None) or ip


def _duplicate(fd: int) -> socket.socket | None:
    try:
        dup = os.dup(fd)
    except OSError:  # closed since it was listed
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:  # not a socket
        os.close(dup)
        return None


def _peer_if_served(sock: socket.socket, local_port: int) -> Peer | None:
    """The peer of a TCP connection accepted on `local_port`, else None."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return None
    try:
        local, remote = sock.getsockname(), sock.getpeername()
    except OSError:  # a listening socket, or one whose connection is gone
        return None
    return (_plain(remote[0]), remote[1]) if local[1] == local_port else None


def locate(peers: set[Peer], local_port: int) -> dict[Peer, int]:
    """The descriptor of each of `peers`' connections accepted on `local_port` that is still open, in one pass over
    the process's descriptors."""
    found: dict[Peer, int] = {}
    for name in os.listdir(_FD_DIR):
        sock = _duplicate(int(name))
        if sock is None:
            continue
        with sock:
            peer = _peer_if_served(sock, local_port)
        if peer in peers:
            found[peer] = int(name)
    return found


@contextlib.contextmanager
def connection(fd: int, peer: Peer, local_port: int) -> Iterator[socket.socket | None]:
    """Descriptor `fd` as a socket while this block runs, if it is still `peer`'s connection; else None."""
    sock = _duplicate(fd)
    if sock is None:
        yield None
        return
    with sock:
        yield sock if _peer_if_served(sock, local_port) == peer else None


def reset(sock: socket.socket) -> None:
    """End the connection: grpc core sees it end at once and cancels its calls; once core closes its descriptor the
    client gets a reset (SO_LINGER 0, as the HTTP port's conn_guard.reset) and the kernel drops what it still held."""
    drop_on_close(sock)
    with contextlib.suppress(OSError):  # gone meanwhile: nothing left to end
        sock.shutdown(socket.SHUT_RDWR)
