"""POST /embed_all counted answered once the kernel has taken its answer's last byte, not once the last piece was
handed to uvicorn's `send` (server/http/held_answer.py): a real `surge serve` with a send deadline, raw sockets.

The answer goes out in pieces of held_answer.PIECE, each handed over once the transport has (nearly) drained, so
after the last one the transport holds at most about a piece. The case: the kernels' buffers fill up in the last
piece. Where that happens is found, not guessed: a client that never reads a big answer leaves the kernels full
(the server's send queue, its own receive queue: /proc/net/tcp) at the same byte of the response every time, on
the same kind of connection; the answer then asked for is sized (its inputs) so that its last piece starts before
that byte and ends after it.

- such an answer, never read: its last piece was handed over and the transport keeps its tail, so the send
  deadline cuts the connection; counted a failure "cancelled", no latency observed, no KServe statistics success.
  Before, counted answered at the hand-over (and a KServe success once computed);
- the same answer whose client pauses there, then reads it all: not counted while its tail waits in the server,
  then answered, once.

Every wait is for an outcome (a metric, the kernels' queues, the server's closing the socket), never a sleep as an
assertion.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from surge.server.http.held_answer import PIECE
from tests import delivery_counts, metrics_scrape, raw_sockets
from tests.delivery_counts import ended as _ended
from tests.server_process import ServerProcess, fresh_client

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernels' queues in /proc")

MODEL = "all-MiniLM-L6-v2"
SEND_TIMEOUT_S = 3
WAIT_S = 90  # how long a test waits for an outcome: far above SEND_TIMEOUT_S
LONG = "the quick brown fox jumps over the lazy dog " * 80  # truncated to the model's 256 tokens
BIG = 6  # inputs of LONG: ~7 MB of JSON, more than the kernels take (tcp_wmem's 4 MB at most, and a small window)
MARGIN = 16 * 1024  # the answer's tail left in the transport, at least


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--threads", "1", env={"SURGE_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S)}) as srv:
        yield srv


def _scrape(url: str) -> dict:
    return metrics_scrape.scrape(url, MODEL)


def _successes(url: str) -> int:
    """The model's KServe statistics successes (server/state.AppState.call records /embed_all's)."""
    return delivery_counts.successes(url, MODEL)


def _body(inputs: list[str]) -> bytes:
    return json.dumps({"inputs": inputs}).encode()


class Unread(delivery_counts.Unread):
    """A request for `inputs` on a socket with a `window`-byte receive buffer, read only up to its answer's head
    (the answer is being sent)."""

    def __init__(self, port: int, inputs: list[str], window: int):
        super().__init__(port, "/embed_all", _body(inputs), WAIT_S, window=window)

    def last_piece(self) -> int:
        """The byte of the response where the answer's last piece starts."""
        return self.head + (self.length - 1) // PIECE * PIECE


def _full_at(port: int, window: int) -> tuple[int, int, int]:
    """(the byte of the response at which the kernels are full for a client that reads nothing past the head, on a
    `window`-byte receive buffer; the head's length; JSON bytes of a LONG input's answer). Found with an answer far
    larger: it stays full there until the send deadline resets the connection, which ends the watch."""
    r = Unread(port, [LONG] * BIG, window)
    try:
        most, deadline = 0, time.monotonic() + WAIT_S
        while (now := r.in_kernels()) is not None and time.monotonic() < deadline:
            most = max(most, now)
            time.sleep(0.02)
    finally:
        r.sock.close()
    assert most + 2 * PIECE < r.head + r.length, (most, r.length)  # the answer was larger than the kernels take
    return most, r.head, (r.length - 2) // BIG


def _tail(words: int) -> list[str]:
    """`words` one-token words as inputs of at most 200 words each."""
    return [" ".join(["word"] * min(200, words - at)) for at in range(0, words, 200)]


def _answer_length(url: str, inputs: list[str]) -> int:
    with fresh_client(url, timeout=WAIT_S) as c:
        r = c.post("/embed_all", content=_body(inputs), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    return len(r.content)


@pytest.fixture(scope="module")
def straddling(server):
    """(inputs, window, the byte at which the kernels fill): inputs whose answer's last piece starts before that
    byte and ends at least MARGIN after it. Found by asking (clients that read their answers)."""
    for window in (4096, 16384, 65536):  # another window moves the byte, should it fall at a piece's very end
        full, head, per_long = _full_at(server.port, window)
        body_full = full - head  # the same head's length for an answer of as many digits
        lo, hi = body_full + MARGIN, body_full - body_full % PIECE + PIECE
        if hi - lo >= 64 * 1024:
            break
    else:
        pytest.fail(f"the kernels fill too near a piece's end on every window tried ({full})")
    per_token = per_long / 256
    target = (lo + hi) // 2
    longs = max(int((target - 20 * per_token) // per_long), 0)
    words = int((target - longs * per_long) / per_token)
    for _ in range(12):
        inputs = [LONG] * longs + _tail(words)
        length = _answer_length(server.url, inputs)
        if lo < length <= hi:
            return inputs, window, full
        words = max(1, words + round((target - length) / per_token))
    pytest.fail(f"no answer of {lo}-{hi} bytes found (last {length})")


def _straddles(r: Unread, full: int) -> None:
    """The case: the kernels fill within the answer's last piece, short of its end."""
    assert r.last_piece() <= full < r.head + r.length - MARGIN // 2, (r.last_piece(), full, r.head + r.length)


def test_an_answer_cut_after_its_last_piece_was_handed_over_is_cancelled(server, straddling):
    inputs, window, full = straddling
    before, successes = _scrape(server.url), _successes(server.url)
    r = Unread(server.port, inputs, window)
    try:
        _straddles(r, full)
    except BaseException:
        r.sock.close()
        raise
    # Nothing more is read: the whole answer has been handed to the transport, which keeps its tail until the send
    # deadline resets the connection; watched until the server has reset it and counted the request.
    got, most, after = delivery_counts.until_cut(r, server.url, MODEL, before, WAIT_S)
    # the case, as sized: some of the last piece reached the kernels (so all of it was handed over), not all
    assert r.last_piece() < most < r.total, (r.last_piece(), most, r.total)
    assert len(got) < r.total  # cut: not sent whole
    delivery_counts.assert_cancelled_only(server.url, MODEL, before, after, successes)


def test_an_answer_whose_tail_waits_in_the_server_is_answered_once_read(server, straddling):
    inputs, window, full = straddling
    before, successes = _scrape(server.url), _successes(server.url)
    r = Unread(server.port, inputs, window)
    try:
        _straddles(r, full)
        deadline = time.monotonic() + WAIT_S
        while (now := r.in_kernels()) is not None and now < full - 4096 and time.monotonic() < deadline:
            time.sleep(0.01)
        # the kernels full: the answer's tail waits in the server's transport
        assert now is not None and now >= full - 4096, (now, full)
        waiting = _scrape(server.url)  # well within the send deadline (a reset only past SEND_TIMEOUT_S)
        waiting_successes = _successes(server.url)
        got = r.got + raw_sockets.read_to_close(r.sock)  # the rest, then the server's close (`connection: close`)
    finally:
        r.sock.close()
    assert _ended(before, waiting) == 0  # not counted while its tail was not the kernel's
    assert waiting_successes == successes  # nor a KServe success (before: counted once computed)
    rows = json.loads(got[r.head:])
    assert [len(x) for x in rows] == [256] * inputs.count(LONG) + [len(t.split()) + 2 for t in inputs if t != LONG]
    delivery_counts.assert_answered_once(server.url, MODEL, before, successes, WAIT_S)
