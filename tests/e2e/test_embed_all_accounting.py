"""TEI's POST /embed_all accounted for as every other request, against a real `surge serve` process:

- its answer (JSON, about 3x its float rows) stays under admission control until the kernel has taken its last
  byte, so clients that ask for big answers and do not read them hold admission slots, and the
  next request is refused with 429 instead of being computed and held in memory too (raw sockets that
  read only the status line: tests/raw_sockets.py);
- it is counted as a request of its model where /embed is: surge_requests_total, surge_inputs_total,
  failures by code, the latency histogram, and KServe's statistics extension (GET /v2/models/{m}/stats),
  moved by exactly the requests sent.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import numpy as np
import pytest

from tests import metrics_scrape
from tests.metrics_scrape import delta
from tests.raw_sockets import post_until_head, read_to_close
from tests.server_process import ServerProcess, fresh_client

MODEL = "all-MiniLM-L6-v2"
LONG = "the quick brown fox jumps over the lazy dog " * 80  # past the model's 256 tokens: truncated to 256
HIDDEN = 384
PER_CLIENT = 8  # long inputs a slow client asks for: 8 x 256 x 384 floats, ~9 MB of JSON, past what the
# kernel's buffers take for a client that does not read (the server's send buffer grows to tcp_wmem's 4 MB)
SLOW_CLIENTS = 2
MAX_INFLIGHT = PER_CLIENT * SLOW_CLIENTS  # the slow clients' requests take every admission slot
MAX_TOKEN_STATES = PER_CLIENT * 256 * HIDDEN * 4


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--threads", "1", "--max-inflight", str(MAX_INFLIGHT),
                       "--max-token-states-bytes", str(MAX_TOKEN_STATES)) as srv:
        yield srv


def _post(server, body) -> httpx.Response:
    with fresh_client(server.url, timeout=120) as c:
        return c.post("/embed_all", json=body)


def _slow_request(port: int) -> tuple[socket.socket, bytes]:
    """Sends a max-size /embed_all on a socket with a small receive buffer and reads only until the answer's
    head has come (it is being sent: computed and serialized); returns the socket and what came so far."""
    s, got = post_until_head(port, "/embed_all", json.dumps({"inputs": [LONG] * PER_CLIENT}).encode(), 120)
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
    return s, got


def _read_answer(s: socket.socket, got: bytes) -> list:
    got += read_to_close(s)  # the request said `connection: close`
    head, body = got.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    assert len(body) == length
    return json.loads(body)


def test_answers_not_yet_read_hold_their_admission_slots(server):
    """Two clients whose max-size answers are being sent, unread, hold every slot: the next request is
    refused with 429 (before, the slots were freed before the answers were even serialized, and it was
    computed, its answer held in memory beside theirs). A client that reads gets its whole answer; once the
    slow clients are done or gone, the server answers again."""
    slow = [_slow_request(server.port) for _ in range(SLOW_CLIENTS)]
    try:
        r = _post(server, {"inputs": "one more"})
        assert r.status_code == 429, r.text[:300]
        assert r.json()["error_type"] == "Overloaded"
        rows = _read_answer(*slow[0])  # read after all: the whole answer, correct in shape
        assert np.asarray(rows, dtype=np.float32).shape == (PER_CLIENT, 256, HIDDEN)
    finally:
        for s, _ in slow:
            s.close()
    # The server notices the closed connection on its own time: wait for it (a liveness check, not a timing)
    deadline = time.monotonic() + 60
    while (r := _post(server, {"inputs": "one more"})).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200, r.text[:300]


def test_embed_all_is_counted_as_a_request_of_its_model(server):
    """/metrics and KServe's statistics move by exactly the /embed_all requests sent: three answered (6
    inputs), two refused (422: too long without truncation; 413: an answer past the limit), each a
    failure under its code."""
    def stats():
        (m,) = httpx.get(server.url + f"/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"]
        return m

    def scrape():
        return metrics_scrape.scrape(server.url, MODEL)

    before, kserve_before = scrape(), stats()
    for inputs in (["a short one"], ["two", "inputs"], ["and", "three", "more"]):
        assert _post(server, {"inputs": inputs}).status_code == 200
    r = _post(server, {"inputs": LONG, "truncate": False})
    assert r.status_code == 422, r.text[:300]
    r = _post(server, {"inputs": [LONG] * (PER_CLIENT + 1)})
    assert r.status_code == 413, r.text[:300]
    after, kserve_after = scrape(), stats()

    assert delta(before, after, "surge_requests_total") == 5
    assert delta(before, after, "surge_inputs_total") == 6 + 1 + PER_CLIENT + 1
    # both under their error's code (the too-long input too: surge's 413, which TEI's routes answer 422)
    assert delta(before, after, "surge_request_failures_total", code="payload_too_large") == 2
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == 2
    assert delta(before, after, "surge_request_latency_seconds_count") == 3  # answered ones, as /embed's

    b, a = kserve_before["inference_stats"], kserve_after["inference_stats"]
    assert a["success"]["count"] - b["success"]["count"] == 3
    assert a["fail"]["count"] - b["fail"]["count"] == 2
    assert kserve_after["inference_count"] - kserve_before["inference_count"] == 6
    assert kserve_after["execution_count"] - kserve_before["execution_count"] == 6  # one engine run an input
