"""`surge serve --workers 2`: a lone connection is handed to the engine process, which serves it
itself (server/http/handoff.py); real processes, real HTTP, the FP32 reference.

Which process serves a connection is read from the kernel (psutil): the engine process holds the
TCP connection of a handed one (its front end keeps only a duplicate, without reading it)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time

import numpy as np
import psutil
import pytest

from tests.conftest import cosine_rows
from tests.server_process import ServerProcess, children_by_role

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    # Deadlines far above any wait here: the claims are about whose connection is whose, and on a loaded
    # 2-core machine three clients of 16 long inputs queue for tens of seconds (504s at the default 30 s).
    with ServerProcess("--workers", "2", "--engine", "torch", "--device", "cpu", "--cache-bytes", "0",
                       "--max-batch-size", "16", "--request-timeout-s", "150") as srv:
        yield srv


def _roles(srv) -> dict[int, str]:
    return {p.pid: role for role, procs in children_by_role(srv).items() for p in procs}


def _holders(srv, conn: http.client.HTTPConnection) -> set[str]:
    """The roles of the processes that hold this client connection's server side."""
    port = conn.sock.getsockname()[1]
    held = set()
    for pid, role in _roles(srv).items():
        try:
            conns = psutil.Process(pid).net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        if any(c.raddr and c.raddr.port == port for c in conns):
            held.add(role)
    return held


def _post(conn: http.client.HTTPConnection, texts: list[str]):
    conn.request("POST", "/v1/embeddings", body=json.dumps({"input": texts}),
                 headers={"content-type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read(), dict(r.getheaders())


def _connect(srv) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.connect()
    return conn


def _until(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _handed_connection(srv) -> http.client.HTTPConnection:
    """A new connection that the engine process serves (the slot frees as an earlier one closes)."""
    box = []

    def handed():
        if box:
            box.pop().close()
        conn = _connect(srv)
        box.append(conn)
        _post(conn, ["warm"])
        return "engine" in _holders(srv, conn)

    assert _until(handed)
    return box[0]


def _check(status, body, headers, texts, reference_embed):
    assert status == 200, body
    got = np.array([d["embedding"] for d in json.loads(body)["data"]], np.float32)
    assert cosine_rows(got, reference_embed(texts)).min() >= 0.9999


def test_one_connection_goes_to_the_engine_process_the_next_stays_with_a_front_end(server, sentences,
                                                                                     reference_embed):
    rng = np.random.default_rng()
    pick = lambda: [sentences[i] for i in rng.choice(len(sentences), int(rng.integers(1, 4)), replace=False)]  # noqa: E731
    lone = _handed_connection(server)  # the first that finds the slot free (a closing one may hold it)
    for _ in range(3):
        texts = pick()
        _check(*_post(lone, texts), texts, reference_embed)
    assert "engine" in _holders(server, lone)
    other = _connect(server)  # the engine process serves one (--engine-connections 1): this one stays
    texts = pick()
    _check(*_post(other, texts), texts, reference_embed)
    assert _holders(server, other) == {"front"}
    lone.close()  # its slot is free again: the next new connection is the engine process's
    again = None

    def next_is_handed():
        nonlocal again
        if again is not None:
            again.close()
        again = _connect(server)
        t = pick()
        _check(*_post(again, t), t, reference_embed)
        return "engine" in _holders(server, again)

    assert _until(next_is_handed)
    again.close()
    other.close()


def test_a_handed_connection_goes_back_to_its_front_end_while_front_ends_keep_the_engine_busy(
        server, sentences, reference_embed):
    """Front ends' requests in the engine process's batcher: the handed connection is given back
    after its next response (nothing of a next request read) and goes on, correct, at the front end."""
    import threading

    lone = _handed_connection(server)
    long = [" ".join(sentences[i:i + 12]) for i in range(0, 32, 2)]  # a batch of 16 long inputs
    stop = threading.Event()
    errors: list = []

    def keep_busy():  # front ends' connections (the engine process serves one only: the lone one)
        c = _connect(server)
        while not stop.is_set():
            c.request("POST", "/embed", body=json.dumps({"inputs": long}), headers={"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            if r.status != 200:
                errors.append(r.status)
        c.close()

    # Three of them, so that some front end's request is in the engine's batcher at nearly any time.
    busy = [threading.Thread(target=keep_busy) for _ in range(3)]
    for b in busy:
        b.start()
    try:
        rng = np.random.default_rng()

        def given_back():
            texts = [sentences[int(i)] for i in rng.choice(len(sentences), 2, replace=False)]
            _check(*_post(lone, texts), texts, reference_embed)
            return "engine" not in _holders(server, lone)

        assert _until(given_back, 120)
    finally:
        stop.set()
        for b in busy:
            b.join(120)
    assert errors == []
    assert _holders(server, lone) == {"front"}
    for _ in range(3):  # the same client connection goes on, at the front end now
        texts = [sentences[int(i)] for i in rng.choice(len(sentences), 3, replace=False)]
        _check(*_post(lone, texts), texts, reference_embed)
    assert _holders(server, lone) == {"front"}
    lone.close()


def test_a_dead_engine_answers_503_at_once_on_its_handed_connection_then_serves_again(server, sentences,
                                                                                      reference_embed):
    conn = _handed_connection(server)
    (engine_pid,) = [pid for pid, role in _roles(server).items() if role == "engine"]
    # Frozen, the engine process cannot read the next request: it is in flight when the process dies.
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        conn.request("POST", "/v1/embeddings", body=json.dumps({"input": [sentences[0]]}),
                     headers={"content-type": "application/json"})
        time.sleep(0.2)
    finally:
        os.kill(engine_pid, signal.SIGKILL)
    t0 = time.monotonic()
    r = conn.getresponse()
    body = r.read()
    assert r.status == 503, body
    assert r.getheader("retry-after") == "1"
    assert json.loads(body)["error"]["code"] == "not_ready"
    assert time.monotonic() - t0 < 30  # at once, not after a timeout
    conn.close()
    assert _until(lambda: any(role == "engine" and pid != engine_pid for pid, role in _roles(server).items()), 120)

    answers = []

    def serves_again():
        # Each front end reconnects to the new engine on its own (a 503 with Retry-After until then) and the
        # kernel spreads new connections over them: back means every one of several fresh connections serves.
        answers.clear()
        try:
            for _ in range(8):
                c = _connect(server)
                answers.append(_post(c, sentences[3:6]))
                c.close()
                if answers[-1][0] != 200:
                    return False
        except OSError:
            return False
        return True

    assert _until(serves_again, 180), answers[-1:]
    for answer in answers:
        _check(*answer, sentences[3:6], reference_embed)
