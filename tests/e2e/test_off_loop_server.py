"""A large generation request no longer holds the server's event loop while it is prepared (runtime/off_loop.py):
a real `surge serve` process of a tiny decoder, called over plain HTTP.

Each large request here costs its preparation seconds of work (hundreds of thousands of bad words to tokenize,
a chat of tens of thousands of messages to render) and then fails at the preparation's very end (a check of
its sampling parameters): before, that work ran on the event loop and its 400 was written before the loop
read anything else, so a probe sent meanwhile on another connection was answered after it. Now the probe is
answered while the large request is still being prepared. Ordering, not timing: the probe's answer is read
whole while the large request's connection has nothing to read yet (a fast machine only shortens the
preparation, which stays far longer than a probe's answer).
"""

from __future__ import annotations

import http.client
import json
import select
import time

import pytest

pytest.importorskip("torch")

from tests.decoder_models import build_model  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

NAME = "offloop-qwen"
BAD = [f"w{i}" for i in range(400_000)]  # ~4 MB: seconds of tokenization
TURNS = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"turn {k}"} for k in range(200_000)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = build_model("qwen2", tmp_path_factory.mktemp("offloop") / NAME, seed=5)
    with ServerProcess(str(d), "--threads", "1", "--max-body-bytes", str(16 << 20)) as srv:
        yield srv


def _chunks(data: bytes):
    for k in range(0, len(data), 1 << 20):
        yield data[k:k + (1 << 20)]


def _probe_while_large(srv, path: str, body: dict, chunked: bool = False) -> tuple[bool, int, dict]:
    """(whether a probe sent once the large request is in was answered before it, the large one's status and
    body)."""
    data = json.dumps(body).encode()
    probe = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    probe.request("GET", "/health")  # connected and answered before the large request starts
    assert probe.getresponse().read()
    large = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    headers = {"Content-Type": "application/json"}
    if chunked:  # no Content-Length: the routes read it (common.checked_body), not the hot path
        large.request("POST", path, body=_chunks(data), headers=headers, encode_chunked=True)
    else:
        large.request("POST", path, body=data, headers=headers)
    # The whole body is in the server's socket (the kernel's buffers hold at most a few hundred KB of it);
    # a moment more and its preparation, seconds long, is under way.
    time.sleep(0.3)
    probe.request("GET", "/health")
    answer = probe.getresponse()
    assert answer.status == 200 and answer.read()
    first = not select.select([large.sock], [], [], 0)[0]  # the large request's answer is not there yet
    r = large.getresponse()
    status, out = r.status, json.loads(r.read())
    probe.close()
    large.close()
    return first, status, out


@pytest.mark.parametrize("path, body, chunked", [
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "bad_words": BAD,
                              "max_tokens": 1, "min_tokens": 2}, False),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "bad_words": BAD, "max_tokens": 1, "min_tokens": 2}, True),
    (f"/v2/models/{NAME}/generate", {"text_input": "hi", "parameters": {"bad_words": BAD, "max_tokens": 1,
                                                                        "min_tokens": 2}}, False),
    ("/v1/chat/completions", {"model": NAME, "messages": TURNS, "max_tokens": 1, "min_tokens": 2}, False),
], ids=["chat_bad_words", "completions_bad_words_routes", "kserve_bad_words", "chat_200k_messages"])
def test_a_probe_is_answered_while_a_large_request_is_prepared(server, path, body, chunked):
    first, status, out = _probe_while_large(server, path, body, chunked)
    # the same 400 as before, found at the preparation's end
    assert status == 400, out
    assert "min_tokens" in json.dumps(out)
    assert first, "the probe was answered only after the large request's preparation"
