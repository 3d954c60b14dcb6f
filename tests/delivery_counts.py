"""What the delivery tests (tests/e2e/test_*answer_delivery.py, test_embed_all_delivery.py) read of a real server:
a request whose answer is left unread on a small receive window, and the counts (/metrics, KServe statistics) an
answer makes once it is cut or read. Every wait is for an outcome, never a sleep as an assertion."""

from __future__ import annotations

import time

import httpx

from tests import metrics_scrape, raw_sockets
from tests.metrics_scrape import delta


def successes(url: str, model: str) -> int:
    """`model`'s KServe statistics successes (server/state.AppState.call records them)."""
    stats = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30).json()["model_stats"]
    return sum(s["inference_stats"]["success"]["count"] for s in stats)


def ended(before: dict, after: dict) -> float:
    """Requests that ended between two scrapes: answered (latency observed) or failed."""
    return (delta(before, after, "surge_request_latency_seconds_count")
            + metrics_scrape.total(before, after, "surge_request_failures_total"))


def content_length(head: bytes) -> int:
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))


class Unread:
    """A POST on a socket with a `window`-byte receive buffer, read only up to its answer's head (the answer is
    being sent; the kernels hold what they take of it)."""

    def __init__(self, port: int, path: str, body: bytes, wait_s: float, window: int = 4096):
        self.sock, self.got = raw_sockets.post_until_head(port, path, body, wait_s, window=window)
        head = self.got.split(b"\r\n\r\n", 1)[0]
        assert head.startswith(b"HTTP/1.1 200"), self.got[:300]
        self.head, self.length = len(head) + 4, content_length(head)  # the head's bytes, the body's
        self.total = self.head + self.length
        self.ports = self.sock.getsockname()[1], self.sock.getpeername()[1]

    def in_kernels(self) -> int | None:
        """Bytes of the response handed to the server's kernel so far (read, or held by the kernels); None once
        the server's socket is gone."""
        held = raw_sockets.held_by_kernels(*self.ports)
        return None if held is None else len(self.got) + held


def until_cut(r: Unread, url: str, model: str, before: dict, wait_s: float) -> tuple[bytes, int, dict]:
    """Reads nothing more until the server has reset `r`'s connection and counted the request: (all the client
    got, the most the kernels ever held, the scrape after). Closes the socket."""
    try:
        most, deadline, after = 0, time.monotonic() + wait_s, before
        while time.monotonic() < deadline:
            now = r.in_kernels()
            most = max(most, now or 0)
            after = metrics_scrape.scrape(url, model)
            if now is None and ended(before, after) >= 1:
                break
            time.sleep(0.1)
        got = r.got + raw_sockets.read_to_close(r.sock)  # what this kernel held, then the reset
    finally:
        r.sock.close()
    return got, most, after


def read_rest(r: Unread) -> bytes:
    """The whole response: what came, the rest, then the server's close (`connection: close`). Closes the socket."""
    try:
        return r.got + raw_sockets.read_to_close(r.sock)
    finally:
        r.sock.close()


def assert_cancelled_only(url: str, model: str, before: dict, after: dict, successes_before: int) -> None:
    """One request, counted a failure "cancelled" and nothing else: no latency, no KServe success."""
    assert delta(before, after, "surge_requests_total") == 1
    assert delta(before, after, "surge_request_failures_total", code="cancelled") == 1
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == 1
    assert delta(before, after, "surge_request_latency_seconds_count") == 0
    assert successes(url, model) == successes_before  # not a KServe success either


def assert_answered_once(url: str, model: str, before: dict, successes_before: int, wait_s: float) -> None:
    """Waits for one request to be counted, then asserts it counted answered once: its latency, no failure, one
    KServe success."""
    deadline = time.monotonic() + wait_s
    while ended(before, after := metrics_scrape.scrape(url, model)) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert delta(before, after, "surge_requests_total") == 1
    assert metrics_scrape.total(before, after, "surge_request_failures_total") == 0
    assert delta(before, after, "surge_request_latency_seconds_count") == 1
    deadline = time.monotonic() + wait_s
    while successes(url, model) == successes_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert successes(url, model) == successes_before + 1

