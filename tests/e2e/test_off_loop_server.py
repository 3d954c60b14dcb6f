"""A large generation request no longer holds the server's event loop while it is prepared (runtime/off_loop.py):
a real `surge serve` process of a tiny decoder, called over plain HTTP and gRPC (tritonclient).

Each large request here costs its preparation seconds of work (hundreds of thousands of bad words to tokenize,
a chat of tens of thousands of messages to render) and then fails at the preparation's very end (a check of
its sampling parameters): before, that work ran on the event loop and its 400 was written before the loop
read anything else, so a probe sent meanwhile on another connection was answered after it. Now the probe is
answered while the large request is still being prepared. The tokenizer routes (vLLM's /tokenize and
Anthropic's count_tokens) answer 200 after seconds of rendering or tokenizing; the gRPC calls fail as the
HTTP ones do. (/detokenize and TEI's /decode are not here: their parse, on a thread already, is about as long
as the decode that was on the loop, so where a probe lands depends on timing; benchmarks/loop_stall.py
measures them.) Ordering, not timing: the probe's answer is read
whole while the large request's connection has nothing to read yet (a fast machine only shortens the
preparation, which stays far longer than a probe's answer).
"""

from __future__ import annotations

import http.client
import json
import queue
import select
import threading
import time

import pytest

pytest.importorskip("torch")

from tests.decoder_models import build_model  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.triton_inputs import vllm_backend_inputs  # noqa: E402

NAME = "offloop-qwen"
BAD = [f"w{i}" for i in range(400_000)]  # ~4 MB: seconds of tokenization
TURNS = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"turn {k}"} for k in range(200_000)]
FAILING = {"bad_words": BAD, "max_tokens": 1, "min_tokens": 2}  # seconds of bad words, then a 400


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = build_model("qwen2", tmp_path_factory.mktemp("offloop") / NAME, seed=5)
    with ServerProcess(str(d), "--threads", "1", "--max-body-bytes", str(16 << 20), grpc=True) as srv:
        yield srv


def _chunks(data: bytes):
    for k in range(0, len(data), 1 << 20):
        yield data[k:k + (1 << 20)]


def _probe_while(srv, start):
    """(whether a probe sent once the large request is in was answered before it, the large one's outcome).
    `start()` sends the large request; it returns (whether its answer is there yet, a call that waits for it)."""
    probe = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    probe.request("GET", "/health")  # connected and answered before the large request starts
    assert probe.getresponse().read()
    answered, outcome = start()
    # The whole body is in the server's socket (the kernel's buffers hold at most a few hundred KB of it);
    # a moment more and its preparation, seconds long, is under way.
    time.sleep(0.3)
    probe.request("GET", "/health")
    answer = probe.getresponse()
    assert answer.status == 200 and answer.read()
    first = not answered()  # the large request's answer is not there yet
    out = outcome()
    probe.close()
    return first, out


def _probe_while_large(srv, path: str, body: dict, chunked: bool = False) -> tuple[bool, int, dict]:
    """(whether a probe sent once the large request is in was answered before it, the large one's status and
    body)."""
    data = json.dumps(body).encode()
    large = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)

    def start():
        headers = {"Content-Type": "application/json"}
        if chunked:  # no Content-Length: the routes read it (common.checked_body), not the hot path
            large.request("POST", path, body=_chunks(data), headers=headers, encode_chunked=True)
        else:
            large.request("POST", path, body=data, headers=headers)
        return lambda: bool(select.select([large.sock], [], [], 0)[0]), outcome

    def outcome():
        r = large.getresponse()
        status, out = r.status, json.loads(r.read())
        large.close()
        return status, out

    first, (status, out) = _probe_while(srv, start)
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


@pytest.mark.parametrize("path, body, status, key", [
    ("/tokenize", {"model": NAME, "prompt": "word " * 800_000}, 200, "tokens"),
    ("/tokenize", {"model": NAME, "messages": TURNS}, 200, "tokens"),
    # one long message: its parse is short, its tokenization long (the parse is on a thread already)
    ("/v1/messages/count_tokens", {"model": NAME, "messages": [{"role": "user", "content": "word " * 800_000}]},
     200, "input_tokens"),
    (f"/v2/models/{NAME}/infer", {"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
        {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": [json.dumps(FAILING)]}]},
     400, "min_tokens"),
], ids=["vllm_tokenize_prompt", "vllm_tokenize_200k_messages",
        "count_tokens_4mb_message", "kserve_infer_bad_words"])
def test_a_probe_is_answered_while_a_large_request_is_prepared_more_routes(server, path, body, status, key):
    first, got, out = _probe_while_large(server, path, body)
    assert got == status and key in json.dumps(out)[:100_000], (got, json.dumps(out)[:300])
    assert first, "the probe was answered only after the large request's preparation"


@pytest.mark.parametrize("streamed", [False, True], ids=["ModelInfer", "ModelStreamInfer"])
def test_a_probe_is_answered_while_a_large_grpc_request_is_prepared(server, streamed):
    tg = pytest.importorskip("tritonclient.grpc")
    client = tg.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    done = threading.Event()

    def callback(result, error):
        got.put((result, error))
        done.set()

    def start():
        if streamed:
            client.start_stream(callback=callback)
            client.async_stream_infer(NAME, vllm_backend_inputs(tg, "hi", FAILING, stream=True))
        else:
            client.async_infer(NAME, vllm_backend_inputs(tg, "hi", FAILING), callback)
        return done.is_set, lambda: got.get(timeout=300)

    try:
        first, (result, error) = _probe_while(server, start)
    finally:
        if streamed:
            client.stop_stream()
        client.close()
    # the same error as before, found at the preparation's end
    assert result is None and error is not None and "min_tokens" in str(error), (result, error)
    assert first, "the probe was answered only after the large request's preparation"
