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

import httpx
import pytest

from tests import delivery_counts, metrics_scrape
from tests.delivery_counts import Unread
from tests.e2e.repo_helpers import add_version
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


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_a_big_task_answer_cut_with_its_tail_in_the_server_is_cancelled(server, kind):
    path, body = REQUESTS[kind]()
    before, successes = _scrape(server.url), delivery_counts.successes(server.url, MODEL)
    r = Unread(server.port, path, body, WAIT_S)
    got, most, after = delivery_counts.until_cut(r, server.url, MODEL, before, WAIT_S)
    assert len(got) < r.total and most < r.total, (len(got), most, r.total)  # the case: never its tail; cut
    delivery_counts.assert_cancelled_only(server.url, MODEL, before, after, successes)


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_a_big_task_answer_read_after_a_pause_is_answered_once_read(server, kind):
    path, body = REQUESTS[kind]()
    before, successes = _scrape(server.url), delivery_counts.successes(server.url, MODEL)
    r = Unread(server.port, path, body, WAIT_S)
    waiting, waiting_successes = _scrape(server.url), delivery_counts.successes(server.url, MODEL)
    now = r.in_kernels()
    got = delivery_counts.read_rest(r)
    assert now is not None and now < r.total  # the case: the tail was still the server's when the counts were read
    assert delivery_counts.ended(before, waiting) == 0 and waiting_successes == successes  # not counted while it waited
    assert len(got) == r.total
    assert len(json.loads(got.split(b"\r\n\r\n", 1)[1])) == N
    delivery_counts.assert_answered_once(server.url, MODEL, before, successes, WAIT_S)
