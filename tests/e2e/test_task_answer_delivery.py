"""Task (classify) answers counted answered (latency on /metrics, KServe statistics success) once the kernel has
taken their last byte, not once computed: a real `surge serve` with a send deadline, raw sockets, as
tests/e2e/test_answer_delivery.py does for embeddings.

A big answer (40,000 short inputs, 5 labels each: ~7.6 MB of JSON from TEI's /predict; seven distinct texts,
computed once when the server starts, so that the answer is the cache's at once) is written whole at once; a
client that reads nothing leaves the kernels full and the rest in the server's transport, so the send deadline
(--send-timeout-s) cuts the connection. Such an answer counts as a failure "cancelled", never as answered too;
before, it counted answered when computed. The same answer read, after a pause with its tail in the server,
counts answered once, after it was read. Cases: the direct path (server/http/direct.py: a plain POST /predict)
and the route (the same with `raw_scores`, an option the direct path hands back).

Every wait is for an outcome (a metric, the server's closing the socket), never a sleep as an assertion.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import pytest

from tests import metrics_scrape, raw_sockets
from tests.e2e.repo_helpers import add_version
from tests.e2e.test_answer_delivery import Unread
from tests.metrics_scrape import delta
from tests.server_process import ServerProcess
from tests.task_models import task_models_dir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernels' queues in /proc")

MODEL = "cls5"
SEND_TIMEOUT_S = 3
WAIT_S = 120  # how long a test waits for an outcome: far above SEND_TIMEOUT_S
N = 40_000  # inputs of a big answer: ~190 bytes of JSON each (a body of ~200 KB: within the direct path's bound)
TEXTS = [f"w{i}" for i in range(7)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("taskrepo")
    add_version(root, MODEL, 1, "engine: {threads: 1, warmup_shapes: [[1, 8]]}\n"
                f"source: {task_models_dir() / MODEL}\n")
    with ServerProcess("--model-repository", str(root), "--threads", "1", "--max-inputs", str(N),
                       env={"SURGE_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S)}) as srv:
        r = httpx.post(f"{srv.url}/predict", json={"inputs": TEXTS, "model": MODEL}, timeout=WAIT_S)
        assert r.status_code == 200, r.text  # every text of the big answers computed (and cached) once
        yield srv


def _inputs() -> list[str]:
    return [TEXTS[i % len(TEXTS)] for i in range(N)]


def _direct() -> tuple[str, bytes]:
    return "/predict", json.dumps({"inputs": _inputs(), "model": MODEL}).encode()


def _route() -> tuple[str, bytes]:
    return "/predict", json.dumps({"inputs": _inputs(), "model": MODEL, "raw_scores": False}).encode()


REQUESTS = {"direct": _direct, "route": _route}


def _scrape(url: str) -> dict:
    return metrics_scrape.scrape(url, MODEL)


def _successes(url: str) -> int:
    stats = httpx.get(f"{url}/v2/models/{MODEL}/stats", timeout=30).json()["model_stats"]
    return sum(s["inference_stats"]["success"]["count"] for s in stats)


def _ended(before: dict, after: dict) -> float:
    return (delta(before, after, "surge_request_latency_seconds_count")
            + metrics_scrape.total(before, after, "surge_request_failures_total"))


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_a_big_task_answer_cut_with_its_tail_in_the_server_is_cancelled(server, kind):
    path, body = REQUESTS[kind]()
    before, successes = _scrape(server.url), _successes(server.url)
    r = Unread(server.port, path, body)
    try:
        most, deadline = 0, time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # until the send deadline has reset the connection and it counted
            now = r.in_kernels()
            most = max(most, now or 0)
            after = _scrape(server.url)
            if now is None and _ended(before, after) >= 1:
                break
            time.sleep(0.1)
        got = r.got + raw_sockets.read_to_close(r.sock)  # what this kernel held, then the reset
    finally:
        r.sock.close()
    assert len(got) < r.total and most < r.total, (len(got), most, r.total)  # the case: never its tail; cut
    assert delta(before, after, "surge_requests_total") == 1
    assert delta(before, after, "surge_request_failures_total", code="cancelled") == 1
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == 1
    assert delta(before, after, "surge_request_latency_seconds_count") == 0
    assert _successes(server.url) == successes  # not a KServe success either


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_a_big_task_answer_read_after_a_pause_is_answered_once_read(server, kind):
    path, body = REQUESTS[kind]()
    before, successes = _scrape(server.url), _successes(server.url)
    r = Unread(server.port, path, body)
    try:
        waiting, waiting_successes = _scrape(server.url), _successes(server.url)
        now = r.in_kernels()
        got = r.got + raw_sockets.read_to_close(r.sock)  # the rest, then the server's close (`connection: close`)
    finally:
        r.sock.close()
    assert now is not None and now < r.total  # the case: the tail was still the server's when the counts were read
    assert _ended(before, waiting) == 0 and waiting_successes == successes  # not counted while it waited
    assert len(got) == r.total
    assert len(json.loads(got.split(b"\r\n\r\n", 1)[1])) == N
    deadline = time.monotonic() + WAIT_S
    while _ended(before, after := _scrape(server.url)) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert delta(before, after, "surge_requests_total") == 1
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == 0
    assert delta(before, after, "surge_request_latency_seconds_count") == 1
    deadline = time.monotonic() + WAIT_S
    while _successes(server.url) == successes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _successes(server.url) == successes + 1
