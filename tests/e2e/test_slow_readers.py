"""Clients that hold an answer by not reading it, against real `surge serve` processes (raw sockets with a
small receive buffer: the attack is in what is *not* read; server/http/conn_guard.py's send deadline):

- a client that asks for a large POST /embed_all answer (held under its admission slot until the transport
  has taken its last byte) and never reads it: with --send-timeout-s the server cuts the connection, the
  slot is freed (with --max-inflight taken by that one request, the next one gets 200 rather than 429), and
  the request counts as a failure ("cancelled") rather than answered. Before, the connection, the answer's
  memory and the slot were held for ever, and every later request got 429;
- a client that reads slowly but steadily is never cut: each byte it takes restarts the clock;
- the same cut under --workers 2, whichever process serves the connection;
- a streamed generation whose client stops reading is cut and its sequences are aborted (running sequences
  and KV use back to 0), counted "cancelled". Before, the stream's handler waited in `send` for ever.

Every wait here is for an outcome (an answer, the server's closing the socket, a metric), bounded far above
the send timeout, never a sleep as an assertion.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests import metrics_scrape, raw_sockets
from tests.metrics_scrape import delta
from tests.server_process import ServerProcess, fresh_client

SEND_TIMEOUT_S = 2
SEND_TIMEOUT = {"SURGE_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S)}
WAIT_S = 60  # how long a test waits for an outcome: far above SEND_TIMEOUT_S
MODEL = "all-MiniLM-L6-v2"
LONG = "the quick brown fox jumps over the lazy dog " * 80  # truncated to the model's 256 tokens
PER_REQUEST = 8  # 8 x 256 x 384 floats: ~9 MB of JSON, past what the kernel's buffers take (tcp_wmem's 4 MB)


@pytest.fixture(scope="module")
def server():
    # --max-inflight: one big request takes every admission slot. The send timeout through its SURGE_*
    # variable: a server without the setting still starts, and the tests then fail on what it does.
    with ServerProcess("--threads", "1", "--max-inflight", str(PER_REQUEST),
                       "--max-token-states-bytes", str(PER_REQUEST * 256 * 384 * 4), env=SEND_TIMEOUT) as srv:
        yield srv


def _post(url: str, body) -> httpx.Response:
    with fresh_client(url, timeout=WAIT_S) as c:
        return c.post("/embed_all", json=body)


def _big_request(port: int) -> tuple[socket.socket, bytes]:
    """A max-size /embed_all on a socket with a small receive buffer, read only until the answer's head has
    come (it is being sent); returns the socket and what came so far."""
    s, got = raw_sockets.post_until_head(port, "/embed_all", json.dumps({"inputs": [LONG] * PER_REQUEST}).encode(),
                                         WAIT_S)
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
    return s, got


def _length(got: bytes) -> tuple[int, bytes]:
    """(the answer's Content-Length, its body so far)."""
    head, body = got.split(b"\r\n\r\n", 1)
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")), body


def test_a_client_that_stops_reading_is_cut_and_its_slot_freed(server):
    before = metrics_scrape.scrape(server.url, MODEL)
    s, got = _big_request(server.port)
    posts = 1
    try:
        r = _post(server.url, {"inputs": "one more"})
        assert r.status_code == 429, r.text[:300]  # the unread answer holds every slot
        # The client still reads nothing: the server must give up on it by itself (before the fix: 429s
        # until the deadline, the slot held for ever).
        deadline = time.monotonic() + WAIT_S
        while r.status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.2)
            r, posts = _post(server.url, {"inputs": "one more"}), posts + 1
        assert r.status_code == 200, r.text[:300]
        got += raw_sockets.read_to_close(s)  # what the kernels held, then the reset (or the close)
    finally:
        s.close()
    length, body = _length(got)
    assert len(body) < length  # cut: the answer was not sent whole
    after = metrics_scrape.scrape(server.url, MODEL)
    assert delta(before, after, "surge_requests_total") == 1 + posts
    # the cut one is a failure, as a client that left ("cancelled"), not an answered request; the others
    # are the 429s and the one 200
    assert delta(before, after, "surge_request_failures_total", code="cancelled") == 1
    assert delta(before, after, "surge_request_failures_total", code="overloaded") == posts - 1
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == posts


def test_a_client_reading_slowly_but_steadily_is_never_cut(server):
    """The same answer read in small steps with pauses (each far below the send timeout) for longer than
    the send timeout in all: it arrives whole, counted as answered."""
    before = metrics_scrape.scrape(server.url, MODEL)
    s, got = _big_request(server.port)
    start = time.monotonic()
    try:
        length, body = _length(got)
        # 384 KiB a pause: ~1.5 MB/s; ~9 MB take over 20 pauses of 0.25 s (>5 s), past twice the send timeout
        body = raw_sockets.read_in_steps(s, body, length, SEND_TIMEOUT_S / 8, step=384 * 1024)
    finally:
        s.close()
    assert time.monotonic() - start > 2 * SEND_TIMEOUT_S  # the case this checks: slower than the timeout
    rows = json.loads(body)
    assert len(rows) == PER_REQUEST and {len(r) for r in rows} == {256}
    after = metrics_scrape.scrape(server.url, MODEL)
    assert delta(before, after, "surge_requests_total") == 1
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == 0


@pytest.fixture(scope="module")
def workers():
    with ServerProcess("--workers", "2", "--threads", "1", "--max-inflight", str(PER_REQUEST),
                       "--max-token-states-bytes", str(PER_REQUEST * 256 * 384 * 4), env=SEND_TIMEOUT) as srv:
        yield srv


def test_under_workers_a_client_that_stops_reading_is_cut(workers):
    """--workers 2: every process that serves HTTP connections (the front ends, and the engine process that a lone
    client's connection may be handed to: cli/workers_engine.py) has the send deadline, through the same protocol
    (server/http/frontend.py). The unread answer's connection is cut and counted "cancelled" (the metrics of every
    process), and then requests on fresh connections, whichever process takes each, are answered, so that no
    process is left with its slots held (each has its own admission: one that still held them would answer 429)."""
    before = metrics_scrape.scrape(workers.url, MODEL)
    s, got = _big_request(workers.port)
    try:
        # Nothing more is read until the server has given up on this client (a metric, not a sleep)
        deadline = time.monotonic() + WAIT_S
        while delta(before, metrics_scrape.scrape(workers.url, MODEL), "surge_request_failures_total",
                    code="cancelled") < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        got += raw_sockets.read_to_close(s)
    finally:
        s.close()
    length, body = _length(got)
    assert len(body) < length  # cut
    statuses = [_post(workers.url, {"inputs": "one more"}).status_code for _ in range(6)]
    assert statuses == [200] * 6, statuses


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    from tests.decoder_models import build_model

    # ~20M parameters: a decode step of 32 sequences takes tens of milliseconds on a CPU, so their 220 tokens
    # outlast the ~60 steps whose events fill the kernel's buffers plus the send timeout many times over
    model = build_model("llama", tmp_path_factory.mktemp("slowreaders") / "slow-llama", seed=5, hidden_size=512,
                        intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
    with ServerProcess(str(model), "--threads", "1", env=SEND_TIMEOUT) as srv:
        yield srv


def _metric(url: str, name: str, **labels) -> float:
    return sum(v for (n, lab), v in metrics_scrape.scrape(url, "slow-llama").items()
               if n == name and all((k, v2) in lab for k, v2 in labels.items()))


def test_a_stream_whose_client_stops_reading_is_cut_and_its_sequences_freed(decoder):
    """32 choices with every token's top log-probabilities: ~50 KB of events a step, past the kernel's
    buffers (~3 MB) long before the generation ends (the engine does not wait for the client: the stream's
    handler does, in `send`). The client reads the head and stops: the connection is cut, every sequence is
    aborted (their KV blocks freed) and counted as cancelled. Before, the handler waited for ever: nothing
    was cancelled (the sequences ran to their length) and the connection stayed open."""
    url, n = decoder.url, 32
    aborted = _metric(url, "surge_generate_requests_total", finish_reason="abort")
    cancelled = _metric(url, "surge_request_failures_total", code="cancelled")
    body = json.dumps({"model": "slow-llama", "messages": [{"role": "user", "content": "go"}], "stream": True,
                       "n": n, "max_tokens": 220, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
                       "temperature": 1.0, "seed": 3}).encode()
    s = raw_sockets.connect_reading_slowly(decoder.port, WAIT_S)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = s.recv(1024)
        assert got.startswith(b"HTTP/1.1 200"), got[:300]
        # Nothing more is read until the server has given up on this client (a metric, not a sleep)
        deadline = time.monotonic() + WAIT_S
        while _metric(url, "surge_request_failures_total", code="cancelled") == cancelled \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        got += raw_sockets.read_to_close(s)
    finally:
        s.close()
    assert b"data: [DONE]" not in got  # cut
    while (_metric(url, "surge_generate_running_sequences") and time.monotonic() < deadline):
        time.sleep(0.1)
    assert _metric(url, "surge_generate_requests_total", finish_reason="abort") - aborted == n
    assert _metric(url, "surge_request_failures_total", code="cancelled") - cancelled == n
    assert _metric(url, "surge_generate_running_sequences") == 0
    assert _metric(url, "surge_generate_kv_cache_usage_ratio") == 0.0
