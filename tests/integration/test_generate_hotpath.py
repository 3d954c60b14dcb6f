"""server/http/generate_hotpath.py: OpenAI generation requests answered in front of the middleware
stack, checked over real TCP against a real uvicorn server running the real app with a tiny random
decoder (in this process, so that a spy can tell which path answered; the spied functions still run).

- streamed and non-streamed completions and chats, and KServe generate / generate_stream, take the
  hot path, and their answers equal the routes' bytes (a chunked request body goes to the routes) apart from the ids and timestamps, and
  transformers' greedy tokens;
- errors (invalid JSON, schema, unknown model, a prompt that does not fit, a body over the limit)
  get the routes' status and body;
- with an API key configured the routes answer;
- a client that leaves, streamed or not, has its sequence aborted and its KV blocks freed.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from surge.server.http import generate_common, generate_hotpath
from tests.decoder_models import build_model
from tests.integration.test_direct_http import InProcessServer

pytestmark = pytest.mark.timeout(300)


class Spy:
    def __init__(self, monkeypatch):
        self.hot = 0
        self.routes = 0
        settled, respond = generate_hotpath.settled, generate_common.respond

        def counting_settled(*a):  # the hot path answers through it, and only then
            self.hot += 1
            return settled(*a)

        def counting_respond(answer):
            self.routes += 1
            return respond(answer)

        monkeypatch.setattr(generate_hotpath, "settled", counting_settled)
        monkeypatch.setattr(generate_common, "respond", counting_respond)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("hotgen") / "m", seed=7, hidden_size=128,
                       max_position_embeddings=256)


@pytest.fixture
def server(model_dir, monkeypatch):
    spy = Spy(monkeypatch)
    with InProcessServer(model_dir=str(model_dir), model_name="m", engine={"threads": 1}) as srv:
        srv.spy = spy
        yield srv


def _chunked(data: bytes):
    yield data[:7]
    yield data[7:]


def post(srv, path: str, body, *, route: bool = False, stream: bool = False):
    """(status, headers without date, body) of one request; `route`: a chunked body, which only the
    routes take."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    content = _chunked(data) if route else data
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60) as c:
        r = c.post(path, content=content, headers={"Content-Type": "application/json"})
        headers = {k: v for k, v in r.headers.items() if k != "date"}
        return r.status_code, headers, r.content


def normalized(body: bytes, path: str = "") -> bytes:
    """Without what a repeat changes: ids, times, and the prompt tokens the prefix cache held (none the
    first time; Anthropic's input_tokens leave them out)."""
    body = re.sub(rb'"(created|created_at|completed_at|cached_tokens|cache_read_input_tokens)":\d+', rb'"\1":0', body)
    if path.startswith("/v1/messages"):
        body = re.sub(rb'"input_tokens":\d+', b'"input_tokens":0', body)
    body = re.sub(rb'"(id|item_id)":"(resp|msg|fc|toolu)_[0-9a-f]+"', rb'"\1":"x"', body)
    return re.sub(rb'"id":"(chat)?cmpl-[0-9a-f]+"', b'"id":"x"', body)


CASES = [
    ("/v1/completions", {"model": "m", "prompt": "The assignment", "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": "m", "prompt": ["One", "Two more words"], "max_tokens": 6, "temperature": 0,
                         "ignore_eos": True, "logprobs": 2}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Define it."}],
                              "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Define it."}], "max_tokens": 5,
                              "seed": 3, "temperature": 0.8}),
    ("/v1/responses", {"model": "m", "input": "Define it.", "max_output_tokens": 10, "temperature": 0,
                       "ignore_eos": True, "stream": True}),
    ("/v1/responses", {"input": [{"role": "user", "content": "Define it."}], "instructions": "Be brief.",
                       "max_output_tokens": 5, "temperature": 0, "top_logprobs": 2,
                       "include": ["message.output_text.logprobs"]}),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "Define it."}], "max_tokens": 8,
                      "temperature": 0, "stream": True}),
    ("/v1/messages", {"system": "Be brief.", "messages": [{"role": "user", "content": "Define it."}],
                      "max_tokens": 6, "temperature": 0, "stop_sequences": ["\x00"]}),
    ("/v2/models/m/generate", {"text_input": "The assignment", "parameters": {"max_tokens": 7, "temperature": 0},
                               "id": "r1"}),
    ("/v2/models/m/versions/1/generate_stream", {"text_input": "Loops", "max_tokens": 9, "temperature": 0,
                                                 "ignore_eos": True}),
]


def test_answers_equal_the_routes_and_transformers(server, model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    spy = server.spy
    for path, body in CASES:
        hot = post(server, path, body)
        assert spy.hot == 1 and spy.routes == 0, (path, body)
        routed = post(server, path, body, route=True)
        assert spy.routes == 1, (path, body, hot, routed)
        spy.hot = spy.routes = 0
        assert hot[0] == routed[0] == 200
        # a length can differ with the count of cached prompt tokens (0 the first time)
        assert {k: v for k, v in hot[1].items() if k != "content-length"} == \
            {k: v for k, v in routed[1].items() if k != "content-length"}
        assert normalized(hot[2], path) == normalized(routed[2], path)
        if body.get("stream") or path.endswith("_stream"):
            assert hot[1]["content-type"] == "text/event-stream; charset=utf-8"
            assert hot[1]["transfer-encoding"] == "chunked"
            # KServe's, the Responses API's and Anthropic's have none
            assert hot[2].endswith(b"data: [DONE]\n\n") == (bool(body.get("stream")) and path.endswith("completions"))
    # the streamed greedy completion is transformers' greedy continuation
    events = [json.loads(line[6:]) for line in post(server, *CASES[0])[2].decode().split("\n\n")
              if line.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert events[-1]["usage"]["completion_tokens"] == 12
    svc = server.state.registry.get("m")
    ids = svc.encode("The assignment")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert text == svc.decode(out[0, len(ids):].tolist())


ERRORS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"model": "m", "prompt": "x", "temperature": 5}, 422),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/v1/chat/completions", {"model": "m", "messages": []}, 422),
    ("/v1/completions", {"model": "m", "prompt": "word " * 400, "stream": True}, 400),
    ("/v1/completions", {"model": "m", "prompt": "x", "suffix": "y"}, 400),
    ("/v1/completions", {"model": "m", "prompt": "x", "n": 2, "best_of": 3}, 400),
    ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {"99999": 1}}, 400),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400),
    ("/v1/completions", {"model": "m", "prompt": "x", "guided_regex": "a(b"}, 400),
    ("/v1/completions", {"model": "m", "prompt": ["a"] * 20, "n": 128, "stream": True}, 413),
    ("/v1/responses", {"model": "m", "input": "x", "conversation": "conv_1"}, 400),
    ("/v1/responses", {"model": "m", "input": "x", "previous_response_id": "resp_0"}, 404),
    ("/v1/responses", {"model": "m", "input": []}, 400),
    ("/v1/responses", {"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, 400),
    ("/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 300}, 400),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, 422),
    ("/v1/messages", {"model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, 404),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
    ("/v2/models/nope/generate", {"text_input": "x"}, 404),
    ("/v2/models/m/versions/7/generate_stream", {"text_input": "x"}, 404),
    ("/v2/models/m/generate", {"text_input": ""}, 400),  # KServe: any bad input is a 400, as /infer
]


def test_errors_equal_the_routes(server):
    spy = server.spy
    for path, body, status in ERRORS:
        hot = post(server, path, body)
        routed = post(server, path, body, route=True)
        assert spy.hot == 1 and spy.routes == 0, body  # an error answer never reaches respond()
        spy.hot = 0
        assert hot[0] == routed[0] == status, (body, hot, routed)
        assert hot[1] == routed[1] and hot[2] == routed[2]
        err = json.loads(hot[2])["error"]
        assert err["message"] if isinstance(err, dict) else err  # OpenAI's and Anthropic's object, KServe's string


def test_a_body_over_the_limit_goes_to_the_route(model_dir, monkeypatch):
    spy = Spy(monkeypatch)
    with InProcessServer(model_dir=str(model_dir), model_name="m", engine={"threads": 1},
                         limits={"max_body_bytes": 2048}) as srv:
        big = {"model": "m", "prompt": "x" * 4096, "max_tokens": 2}
        status, _, body = post(srv, "/v1/completions", big)
        assert status == 413 and b"exceeds the limit" in body
        assert spy.hot == 0 and spy.routes == 0  # handed to the stack, refused by the route's read_body


def test_an_api_key_leaves_generation_to_the_routes(model_dir, monkeypatch):
    spy = Spy(monkeypatch)
    with InProcessServer(model_dir=str(model_dir), model_name="m", engine={"threads": 1}, api_key="k") as srv:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60) as c:
            body = {"model": "m", "prompt": "The", "max_tokens": 3, "temperature": 0}
            assert c.post("/v1/completions", json=body).status_code == 401
            r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert spy.hot == 0 and spy.routes == 1


def _aborted(srv) -> float:
    text = httpx.get(f"http://127.0.0.1:{srv.port}/metrics").text
    m = re.search(r'surge_generate_requests_total\{[^}]*finish_reason="abort"[^}]*\} ([0-9.]+)', text)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("stream,n", [(True, 1), (False, 1), (True, 3), (False, 3)])
def test_a_client_that_leaves_frees_its_sequence(model_dir, monkeypatch, stream, n):
    spy = Spy(monkeypatch)
    with InProcessServer(model_dir=str(model_dir), model_name="m", engine={"threads": 1}) as srv:
        svc = srv.state.registry.get("m")
        before, free = _aborted(srv), svc.stats()["free_blocks"]
        data = json.dumps({"model": "m", "prompt": "Names", "max_tokens": 240, "temperature": 0,
                           "ignore_eos": True, "stream": stream, "n": n}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            end = time.monotonic() + 30
            while svc.stats()["running"] < n and time.monotonic() < end:
                time.sleep(0.005)
            assert svc.stats()["running"] == n
        end = time.monotonic() + 30
        while (_aborted(srv) < before + n or svc.stats()["running"]) and time.monotonic() < end:
            time.sleep(0.02)
        assert _aborted(srv) == before + n
        assert svc.stats()["running"] == 0 and svc.stats()["free_blocks"] == free
        assert spy.hot == 1 and spy.routes == 0


def test_a_request_refused_for_a_full_queue_leaves_nothing_running(model_dir, monkeypatch):
    """n = 6 with room for 2 in the queue: 429 with Retry-After, and no choice of the refused request goes
    on decoding its 240 tokens for nobody (the engine ran a step or two, its blocks all back)."""
    Spy(monkeypatch)
    with InProcessServer(model_dir=str(model_dir), model_name="m", engine={"threads": 1},
                         generation={"max_waiting": 2}) as srv:
        svc = srv.state.registry.get("m")
        free = svc.stats()["free_blocks"]
        body = {"model": "m", "prompt": "Names", "max_tokens": 240, "temperature": 0.7, "ignore_eos": True, "n": 6}
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 429 and "retry-after" in r.headers
        end = time.monotonic() + 60  # generous: a busy machine reports late; the step count decides
        while (svc.stats()["running"] or svc.stats()["waiting"]) and time.monotonic() < end:
            time.sleep(0.01)
        stats = svc.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["free_blocks"] == free
        assert stats.get("steps", 0) < 100, "the choices already sent must not decode on"
