"""server/grpc/peer_sockets.py on real sockets of this process: a connection accepted on a listening port is found
by the peer address grpc would give, its bytes acknowledged grow as the client reads, and a reset ends it."""

from __future__ import annotations

import ipaddress
import socket
import sys
import time

import pytest

from surge.server.grpc import peer_sockets
from surge.server.tcp_info import bytes_acked


@pytest.mark.parametrize("text, expected", [
    ("ipv4:127.0.0.1:5555", (ipaddress.ip_address("127.0.0.1"), 5555)),
    ("ipv6:[::1]:5555", (ipaddress.ip_address("::1"), 5555)),
    ("ipv6:%5B::1%5D:5555", (ipaddress.ip_address("::1"), 5555)),  # grpc escapes the brackets in newer releases
    ("ipv6:[::ffff:10.0.0.1]:7", (ipaddress.ip_address("10.0.0.1"), 7)),  # a dual-stack socket's IPv4 client
    ("unix:/tmp/surge.sock", None),
    ("ipv4:not-an-address:1", None),
])
def test_peer_of(text, expected):
    assert peer_sockets.peer_of(text) == expected


@pytest.fixture
def accepted():
    """(server side, client side, listening port) of one connection on the loopback, dual-stack as grpc listens."""
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        server, _ = listener.accept()
        with client, server:
            yield server, client, port


def test_a_connection_is_found_by_its_peer_and_ends_when_reset(accepted):
    server, client, port = accepted
    peer = peer_sockets.peer_of(f"ipv4:127.0.0.1:{client.getsockname()[1]}")
    found = peer_sockets.locate({peer}, port)
    assert found == {peer: server.fileno()}
    assert peer_sockets.locate({peer}, port + 1 if port < 65535 else port - 1) == {}  # another port's: not ours
    with peer_sockets.connection(found[peer], peer, port) as sock:
        assert sock is not None
        peer_sockets.reset(sock)
    assert client.recv(1) == b""  # ended
    server.close()  # as grpc core does once the connection has ended
    with peer_sockets.connection(found[peer], peer, port) as sock:
        assert sock is None  # the descriptor is not that connection's any more


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO's tcpi_bytes_acked is Linux's")
def test_bytes_acked_grow_as_the_client_reads(accepted):
    server, client, port = accepted
    peer = peer_sockets.peer_of(f"ipv4:127.0.0.1:{client.getsockname()[1]}")
    fd = peer_sockets.locate({peer}, port)[peer]
    with peer_sockets.connection(fd, peer, port) as sock:
        before = bytes_acked(sock)
    server.sendall(b"x" * 1000)
    assert len(client.recv(1000, socket.MSG_WAITALL)) == 1000
    with peer_sockets.connection(fd, peer, port) as sock:
        deadline = time.monotonic() + 10  # the acknowledgement may trail the data (delayed ACK): wait for it
        while bytes_acked(sock) - before < 1000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bytes_acked(sock) - before == 1000
