"""Clients that hold connections without finishing a request, against a real `surge serve` (raw sockets:
the attack is in what is *not* sent):

- a connection that sends nothing, headers that never end, a body shorter than its Content-Length: each
  is closed (with a 408 once part of a request came) once --request-read-timeout-s has passed since the request began (before, each
  was held for ever, and ~1000 of them, one file descriptor each, took the server off the network), with
  or without the API key (no request is authenticated before its headers are read);
- a connection over --max-connections gets 503 and is closed at once, so that idle connections cannot
  use up the process's file descriptors (by default the limit follows RLIMIT_NOFILE: checked by a server
  started with a low one, which before the fix stopped accepting anything, even /health).

Every wait here is for an outcome (the server's answer or its closing the socket), bounded by a socket
timeout far above the configured read timeout, never a sleep.
"""

from __future__ import annotations

import socket
import sys
import uuid

import httpx
import numpy as np
import pytest

from surge.bench.servers import ServerProc, free_port
from tests import raw_sockets
from tests.conftest import cosine_rows
from tests.e2e.repo_helpers import add_version
from tests.server_process import ROOT, ServerProcess

KEY = "slow-clients-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
READ_TIMEOUT_S = 3
MAX_CONNECTIONS = 6
WAIT_S = 60  # how long a test waits for the server's answer: far above READ_TIMEOUT_S


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow_clients")
    add_version(root, "enc", 1)
    return root


@pytest.fixture(scope="module")
def server(repo):
    # Through SURGE_* variables: a server without these settings still starts, and the tests then fail on
    # what it does (it holds the connections) rather than on an unknown flag.
    env = {"SURGE_REQUEST_READ_TIMEOUT_S": str(READ_TIMEOUT_S), "SURGE_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    with ServerProcess("--model-repository", str(repo), "--threads", "1", "--api-key", KEY, env=env) as srv:
        yield srv


def connect(port: int) -> socket.socket:
    return raw_sockets.connect(port, WAIT_S)




def status_of(raw: bytes) -> int | None:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else None


def embed_ok(url: str) -> bool:
    r = httpx.post(url + "/v1/embeddings", json={"model": "enc", "input": "still serving"}, headers=AUTH, timeout=60)
    return r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


def test_a_connection_that_sends_nothing_is_closed(server):
    with connect(server.port) as s:
        raw = raw_sockets.read_to_close(s)
    # Closed without a word: a client that opened it ahead of use would take a 408 for its next answer.
    assert raw == b"", raw


def test_headers_that_never_end_get_408_without_a_key(server):
    with connect(server.port) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        raw = raw_sockets.read_to_close(s)
    assert status_of(raw) == 408, raw
    assert b"connection: close" in raw.lower()


def test_a_body_shorter_than_its_length_gets_408(server):
    with connect(server.port) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n".encode() + b'{"input": "')
        raw = raw_sockets.read_to_close(s)
    assert status_of(raw) == 408, raw
    assert embed_ok(server.url)


def test_a_chunked_body_without_its_end_gets_408(server):
    with connect(server.port) as s:
        s.sendall(b"POST /v2/models/enc/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + b"2\r\n{\"\r\n")
        raw = raw_sockets.read_to_close(s)
    assert status_of(raw) == 408, raw


def test_complete_requests_on_a_kept_alive_connection_are_untouched(server, reference_embed, sentences):
    texts = [f"{t} {uuid.uuid4().hex}" for t in sentences[20:23]]  # fresh: none is answered from the cache
    streams = []
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        got = []
        for text in texts:
            r = c.post("/v1/embeddings", json={"model": "enc", "input": text})
            assert r.status_code == 200, r.text
            got.append(r.json()["data"][0]["embedding"])
            streams.append(r.extensions["network_stream"])
    assert all(s is streams[0] for s in streams), streams  # one connection, kept alive across the three
    assert cosine_rows(np.asarray(got), reference_embed(texts)).min() > 0.99999


def test_connections_over_the_limit_get_503_at_once(server):
    held, refused = [], None
    try:
        # Each held connection proves it is counted by a full request answered on it (it then stays open,
        # kept alive). The limit may be met before MAX_CONNECTIONS of them where the earlier tests' closed
        # connections have not yet reached the server: open until one is refused.
        for _ in range(MAX_CONNECTIONS + 1):
            s = connect(server.port)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = s.recv(65536)
            if status_of(first) == 200:
                held.append(s)
                continue
            refused = first + raw_sockets.read_to_close(s)
            s.close()
            break
        assert refused is not None and status_of(refused) == 503, (len(held), refused)
        assert 1 <= len(held) <= MAX_CONNECTIONS
        assert b"retry-after" in refused.lower() and b"connection: close" in refused.lower()
    finally:
        for s in held:
            s.close()
    # The held ones gone, the server answers again (a retry until their close has reached it, not a sleep).
    for _ in range(200):
        try:
            if embed_ok(server.url):
                break
        except httpx.HTTPError:
            pass
    else:
        pytest.fail("the server did not answer after the held connections closed")


def test_the_default_limit_keeps_the_server_within_its_file_descriptors(repo):
    """A server whose process may open 400 files: 450 idle connections leave it answering (503 to a new one,
    then 200 once they close), where before it could not accept any (EMFILE) and /health hung."""
    port = free_port()
    argv = ["surge", "serve", "--port", str(port), "--grpc-port", "0", "--model-repository", str(repo),
            "--threads", "1"]
    boot = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400)); "
            f"sys.argv = {argv!r}; runpy.run_module('surge.cli.main', run_name='__main__')")
    with ServerProc("surge-serve-nofile", [sys.executable, "-c", boot], port, ready_timeout_s=180,
                    env={"SURGE_REQUEST_READ_TIMEOUT_S": "600"}, cwd=ROOT) as srv:
        held = [connect(port) for _ in range(450)]
        try:
            with connect(port) as s:  # sends nothing: the answer comes at once, before any request
                raw = raw_sockets.read_to_close(s)
            assert status_of(raw) == 503, raw
        finally:
            for s in held:
                s.close()
        for _ in range(200):
            try:
                if httpx.get(srv.url + "/health", timeout=WAIT_S).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        else:
            pytest.fail("no answer after the idle connections closed:\n" + srv.output())
        assert srv.proc.poll() is None


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def test_headers_beyond_the_limit_get_431_before_they_cost_memory(server):
    """32 MB of small headers, no key: uvicorn kept them all (~10x their size in the server's memory) and
    then answered; now 431 once the headers pass --max-header-bytes, and the rest is never read."""
    before = _peak_rss_kb(server.proc.pid)
    line = b"".join(b"X-%07d: a\r\n" % i for i in range(100_000))  # ~1.3 MB
    with connect(server.port) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(25):
                s.sendall(line)
            s.sendall(b"\r\n")
        except (BrokenPipeError, ConnectionResetError):  # refused and closed halfway: what is wanted
            pass
        raw = raw_sockets.read_to_close(s)
    assert status_of(raw) == 431, raw[:200]
    assert _peak_rss_kb(server.proc.pid) - before < 64 * 1024  # KiB; before the fix ~300 MB more
    assert embed_ok(server.url)


def test_a_long_url_gets_431(server):
    with connect(server.port) as s:
        try:
            s.sendall(b"GET /v1/models?" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw = raw_sockets.read_to_close(s)
    assert status_of(raw) == 431, raw[:200]


def test_ordinary_large_headers_still_pass(server):
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "Cookie": "c=" + "x" * 16_000}, timeout=60)
    assert r.status_code == 200
