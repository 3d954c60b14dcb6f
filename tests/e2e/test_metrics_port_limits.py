"""--metrics-port's bounds on what a client can hold, against a real `surge serve` (raw sockets: the attack
is in what is *not* sent).

It was prometheus_client's threaded server, with a thread per connection and no read timeout: a client that
sent nothing, or half a request, held a thread for ever, and enough of them used up threads or file
descriptors. Now (server/http/metrics_port.py) a request must arrive whole within --request-read-timeout-s
of the connection's opening, else the connection is closed; over its connection limit a new one gets 503
at once and is closed; /metrics keeps answering other clients meanwhile.

Every wait is for an outcome (the server's answer or its closing the socket), bounded far above the
configured timeout, never a sleep.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from tests import raw_sockets
from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess, free_port

READ_TIMEOUT_S = 3
MAX_CONNECTIONS = 4
WAIT_S = 60  # how long a test waits for the server's answer: far above READ_TIMEOUT_S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics_port")
    add_version(root, "enc", 1)
    port = free_port()
    env = {"SURGE_REQUEST_READ_TIMEOUT_S": str(READ_TIMEOUT_S), "SURGE_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    with ServerProcess("--model-repository", str(root), "--threads", "1", "--metrics-port", str(port),
                       env=env) as srv:
        srv.metrics_port = port
        yield srv


def connect(port: int) -> socket.socket:
    return raw_sockets.connect(port, WAIT_S)




def scrape(port: int) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S)


def test_a_silent_connection_is_closed_while_metrics_answer_others(server):
    with connect(server.metrics_port) as silent:
        r = scrape(server.metrics_port)  # answered while the silent one is open
        assert r.status_code == 200 and "process_start_time_seconds" in r.text
        assert raw_sockets.read_to_close(silent) == b""  # socket.timeout (the test fails) if the server holds it


def test_half_a_request_is_closed(server):
    with connect(server.metrics_port) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        raw_sockets.read_to_close(s)


def test_a_dribbled_request_is_closed(server):
    """A byte at a time, each well within the timeout: the deadline is for the whole request, not each read."""
    with connect(server.metrics_port) as s:
        s.settimeout(READ_TIMEOUT_S / 6)
        closed = False
        for _ in range(int(WAIT_S / (READ_TIMEOUT_S / 6))):
            try:
                s.sendall(b"X")
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed


def test_connections_over_the_limit_get_503_at_once(server):
    # Opened at once, none sending anything: those within the limit are held (then closed silently at the
    # read timeout), the others get 503 at once.
    socks = [connect(server.metrics_port) for _ in range(MAX_CONNECTIONS * 4)]
    try:
        answers = [raw_sockets.read_to_close(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    refused = [a for a in answers if a]
    assert len(refused) >= MAX_CONNECTIONS, answers
    assert all(a.startswith(b"HTTP/1.1 503") and b"retry-after" in a.lower() for a in refused), refused
    for _ in range(200):  # the held ones gone, /metrics answers again (a retry until their close arrives)
        try:
            if scrape(server.metrics_port).status_code == 200:
                break
        except httpx.HTTPError:
            pass
    else:
        pytest.fail("no answer after the held connections closed")
