"""A generation whose answer never reached its client is not counted answered: a real `surge serve` with a send
deadline, raw sockets with a small receive buffer (server/http/delivery.py, conn_guard.py's send deadline).

- a JSON answer (written whole at the end) larger than the kernel's buffers, whose client reads its head and
  stops: the connection is cut with the answer's tail still in the server's transport, and each of its
  generations counts as a failure "cancelled", with no latency observed and nothing in the KServe statistics.
  Before, they counted answered as soon as the result came;
- a stream (the Responses API, whose last events repeat the whole output: a tail larger than the kernel's
  buffers) whose client reads up to its last delta and stops: the same. Before, it counted answered when its
  last delta was pulled from the engine;
- the same JSON answer read slowly but steadily arrives whole and counts answered, once: its last bytes waited
  in the transport after the route's last `send`, and counted once the kernel took them.

Every wait is for an outcome (a metric, the server's closing the socket), never a sleep as an assertion.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")

from tests import metrics_scrape, raw_sockets
from tests.decoder_models import build_model
from tests.metrics_scrape import delta
from tests.server_process import ServerProcess

MODEL = "late-llama"
SEND_TIMEOUT_S = 2
WAIT_S = 90  # how long a test waits for an outcome: far above SEND_TIMEOUT_S
N = 24  # choices of the JSON answer: each a request on /metrics
TOKENS = 240
LOGPROBS = {"logprobs": True, "top_logprobs": 20}  # ~1.4 KB of JSON a token: 24 x 240 tokens, ~8 MB


def _kernel_max() -> int:
    """The most a socket's send buffer grows to (tcp_wmem's maximum), which the answers here must exceed."""
    path = Path("/proc/sys/net/ipv4/tcp_wmem")
    return int(path.read_text().split()[2]) if path.exists() else 4 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_model("llama", tmp_path_factory.mktemp("delivery") / MODEL, seed=7, max_position_embeddings=2048)
    with ServerProcess(str(model), "--threads", "1", env={"SURGE_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S)}) as srv:
        yield srv


def _scrape(url: str) -> dict:
    return metrics_scrape.scrape(url, MODEL)


def _stats(url: str) -> dict:
    (m,) = httpx.get(url + f"/v2/models/{MODEL}/stats", timeout=30).json()["model_stats"]
    return m


def _settled(url: str, before: dict, n: int) -> dict:
    """/metrics once `n` generations since `before` have ended either way (answered: a latency observed; or
    failed), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        after = _scrape(url)
        ended = (delta(before, after, "surge_request_latency_seconds_count")
                 + metrics_scrape.total(before, after, "surge_request_failures_total"))
        if ended >= n or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def _chat(n: int) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "go"}], "n": n,
                       "max_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0, "seed": 5,
                       **LOGPROBS}).encode()


def _length(head: bytes) -> int:
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))


def _assert_not_answered(before: dict, after: dict, stats_before: dict, stats_after: dict, n: int) -> None:
    assert delta(before, after, "surge_requests_total") == n
    assert delta(before, after, "surge_request_failures_total", code="cancelled") == n
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == n  # once each
    assert delta(before, after, "surge_request_latency_seconds_count") == 0
    for key in ("success", "fail"):  # a client that left is neither in KServe's statistics
        assert stats_after["inference_stats"][key]["count"] == stats_before["inference_stats"][key]["count"]
    assert stats_after["inference_count"] == stats_before["inference_count"]


def _post_until_head(port: int, body: bytes, gzipped: bool):
    """raw_sockets.post_until_head of a chat request; `gzipped`: its body gzip-encoded, which the hot path leaves
    to the routes (server/http/hotpath.OuterHotPath): the FastAPI route and its response class answer it."""
    if not gzipped:
        return raw_sockets.post_until_head(port, "/v1/chat/completions", body, WAIT_S)
    return raw_sockets.post_until_head(port, "/v1/chat/completions", gzip.compress(body), WAIT_S,
                                       b"content-encoding: gzip\r\n")


@pytest.mark.parametrize("gzipped", [False, True], ids=["hot-path", "routes"])
def test_a_json_answer_cut_before_its_last_byte_is_cancelled(server, gzipped):
    before, stats = _scrape(server.url), _stats(server.url)
    s, got = _post_until_head(server.port, _chat(N), gzipped)
    try:
        head, body = got.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200"), got[:300]
        length = _length(head)
        assert length > _kernel_max() + (1 << 20)  # the case this checks: more than the kernel's buffers take
        # Nothing more is read: the generations have ended, and their answer waits in the server's buffers
        # until the send deadline cuts the connection.
        after = _settled(server.url, before, N)
        body += raw_sockets.read_to_close(s)  # what the kernels held, then the reset
    finally:
        s.close()
    assert len(body) < length  # cut: not sent whole
    _assert_not_answered(before, after, stats, _stats(server.url), N)


def test_a_stream_cut_after_its_last_delta_is_cancelled(server):
    body = json.dumps({"model": MODEL, "input": "go", "stream": True, "max_output_tokens": 1600,
                       "ignore_eos": True, "temperature": 1.0, "seed": 9, "top_logprobs": 20,
                       "include": ["message.output_text.logprobs"]}).encode()
    before, stats = _scrape(server.url), _stats(server.url)
    s = raw_sockets.connect_reading_slowly(server.port, WAIT_S)
    try:
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"event: response.output_text.done" not in got:  # read up to the last delta: the output is whole
            chunk = s.recv(65536)
            assert chunk, got[-300:]
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got[:300]
        # The rest (the output three times over, with its log-probabilities) is not read.
        after = _settled(server.url, before, 1)
        got += raw_sockets.read_to_close(s)
    finally:
        s.close()
    assert b"event: response.completed" not in got  # cut
    _assert_not_answered(before, after, stats, _stats(server.url), 1)


def test_a_json_answer_read_slowly_but_whole_is_answered_once(server):
    """The answer's last bytes wait in the server's transport after the route's last `send` (the client reads
    ~1 MB/s): counted answered once the kernel has taken them, each generation once."""
    before, stats = _scrape(server.url), _stats(server.url)
    s, got = raw_sockets.post_until_head(server.port, "/v1/chat/completions", _chat(N), WAIT_S)
    try:
        head, body = got.split(b"\r\n\r\n", 1)
        length = _length(head)
        body = raw_sockets.read_in_steps(s, body, length, SEND_TIMEOUT_S / 8)
    finally:
        s.close()
    answer = json.loads(body)
    assert len(answer["choices"]) == N
    after = _settled(server.url, before, N)
    assert delta(before, after, "surge_requests_total") == N
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == 0
    assert delta(before, after, "surge_request_latency_seconds_count") == N
    now = _stats(server.url)
    assert now["inference_stats"]["success"]["count"] - stats["inference_stats"]["success"]["count"] == N
    assert now["inference_count"] - stats["inference_count"] == N
