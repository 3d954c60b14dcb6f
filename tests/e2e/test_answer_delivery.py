"""Embedding and KServe infer answers counted answered (latency on /metrics, KServe statistics success) once the
kernel has taken their last byte, not once computed: a real `surge serve` with a send deadline, raw sockets.

A big answer (a batch of 2000 inputs: ~9 MB of JSON) is written whole at once; a client that reads nothing leaves
the kernels full (at most their buffers: tcp_wmem's 4 MB and a 4 KiB window) and the rest of it in the server's
transport, so the send deadline (--send-timeout-s) cuts the connection. Such an answer counts as a failure
"cancelled", never as answered too; before, it counted answered when computed (runtime/outcome.answered, and
the KServe statistics at the next turn of the loop). The same answer read, after a pause with its tail in the
server, counts answered once, after it was read. Cases: the direct hot path (server/http/direct.py: a plain
POST /embed; "cached": the same all cache hits, answered inside the protocol's callback), a FastAPI route (POST /embed with an option), KServe infer (a route too). And a request refused
after its compute (the OpenAI route's too-long input: AppState.run's `check`) counts its failure only, not an
answer too.

Every wait is for an outcome (a metric, the server's closing the socket), never a sleep as an assertion.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import httpx
import pytest

from tests import delivery_counts, metrics_scrape
from tests.delivery_counts import Unread
from tests.delivery_counts import ended as _ended
from tests.metrics_scrape import delta
from tests.server_process import ServerProcess

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernels' queues in /proc")

MODEL = "all-MiniLM-L6-v2"
SEND_TIMEOUT_S = 3
WAIT_S = 90  # how long a test waits for an outcome: far above SEND_TIMEOUT_S
N = 2000  # inputs of a big answer: 2000 rows of 384 floats, ~9 MB of JSON


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--threads", "1", env={"SURGE_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S)}) as srv:
        yield srv


_CALLS = itertools.count()


def _texts() -> list[str]:
    """N short inputs no other request to this module's server asked for (each answer computed, not a cache hit).
    As short as that allows, "<call> <i>" (~5 tokens, not the ~18 of a tag and a time stamp: a quarter of the
    compute): the answer's size, what these tests need, is N rows of 384 floats whatever the inputs."""
    call = next(_CALLS)
    return [f"{call} {i}" for i in range(N)]


def _native() -> tuple[str, bytes]:
    return "/embed", json.dumps({"inputs": _texts()}).encode()  # plain: the direct hot path


def _route() -> tuple[str, bytes]:
    return "/embed", json.dumps({"inputs": _texts(), "normalize": True}).encode()  # an option: the route


def _kserve() -> tuple[str, bytes]:
    texts = _texts()
    return f"/v2/models/{MODEL}/infer", json.dumps(
        {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}).encode()


REQUESTS = {"direct": _native, "cached": _native, "route": _route, "kserve": _kserve}


def _scrape(url: str) -> dict:
    return metrics_scrape.scrape(url, MODEL)


def _successes(url: str) -> int:
    return delivery_counts.successes(url, MODEL)


def _warm(server, kind: str, path: str, body: bytes) -> None:
    """For "cached": the same request read whole first and counted, so that the next one is all cache hits,
    answered by the direct path inside the protocol's callback (server/http/direct.DirectRoutes.answer)."""
    if kind != "cached":
        return
    before = _scrape(server.url)
    r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + WAIT_S
    while _ended(before, _scrape(server.url)) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_a_big_answer_cut_with_its_tail_in_the_server_is_cancelled(server, kind):
    path, body = REQUESTS[kind]()
    _warm(server, kind, path, body)
    before, successes = _scrape(server.url), _successes(server.url)
    r = Unread(server.port, path, body, WAIT_S)
    got, most, after = delivery_counts.until_cut(r, server.url, MODEL, before, WAIT_S)
    assert len(got) < r.total and most < r.total  # the case: the kernels never had its tail; cut
    delivery_counts.assert_cancelled_only(server.url, MODEL, before, after, successes)


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_a_big_answer_read_after_a_pause_is_answered_once_read(server, kind):
    path, body = REQUESTS[kind]()
    _warm(server, kind, path, body)
    before, successes = _scrape(server.url), _successes(server.url)
    r = Unread(server.port, path, body, WAIT_S)
    # its head came: the answer was written whole, computed and handed over; its tail waits in the server
    waiting, waiting_successes = _scrape(server.url), _successes(server.url)
    now = r.in_kernels()
    got = delivery_counts.read_rest(r)
    assert now is not None and now < r.total  # the case: the tail was still the server's when the counts were read
    assert _ended(before, waiting) == 0 and waiting_successes == successes  # not counted while it waited
    assert len(got) == r.total
    delivery_counts.assert_answered_once(server.url, MODEL, before, successes, WAIT_S)


@pytest.mark.parametrize("extra", [{}, {"encoding_format": "base64"}], ids=["direct", "route"])
def test_a_request_refused_after_its_compute_counts_its_failure_only(server, extra):
    """The OpenAI route's too-long input (no truncation asked for) is found once computed (AppState.run's `check`):
    the runtime had counted the request answered; the refusal is its outcome, not a second one. A plain request
    (the direct path) and one with an option (the route)."""
    long = "the quick brown fox jumps over the lazy dog " * 80  # ~720 tokens, over MiniLM's 256
    before, successes = _scrape(server.url), _successes(server.url)
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": [long + str(time.time_ns())], **extra},
                   timeout=WAIT_S)
    assert r.status_code == 400, r.text
    deadline = time.monotonic() + WAIT_S
    while _ended(before, after := _scrape(server.url)) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert delta(before, after, "surge_requests_total") == 1
    assert delta(before, after, "surge_request_failures_total", code="invalid_input") == 1
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == 1
    assert delta(before, after, "surge_request_latency_seconds_count") == 0
    assert _successes(server.url) == successes
