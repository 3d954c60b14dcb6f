"""What one client's request can do to a generation server that others share: a real `surge serve` process of
a tiny decoder (its engine loop in a process of its own, the default; runtime LoRA loading on), called over
HTTP. Each test failed before its fix (session 46's security review):

- a request whose engine message outgrew the Unix socket's buffer (many bad_words, a large grammar, a long
  prompt of a long-context model) was half written to the engine process on uvloop's non-blocking socket: the
  engine process died, every stream in flight with it, and the model answered 503 while it restarted;
- stop strings of 100 KB were searched for (and a partial match of each held back, one slice per length) at
  every token of every choice, on the event loop: a stop string is at most 1,024 characters (400);
- Responses' truncation 'auto' rendered the prompt again for each turn it dropped: thousands of turns held
  the event loop for minutes;
- the Responses store bounded the count of responses kept, not their bytes (--responses-store-bytes), and a
  truncated response was stored with its whole conversation (a chain of them grew without bound);
- a LoRA path with a NUL byte was a 500;
- a request's own `chat_template` (vLLM's field, refused there unless --trust-request-chat-template) was
  silently ignored: the answer came from the model's template, not the one asked for.
"""

from __future__ import annotations

import re

import httpx
import pytest

pytest.importorskip("torch")

from tests.decoder_models import build_model
from tests.server_process import ServerProcess

NAME = "abuse-qwen"
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = build_model("qwen2", tmp_path_factory.mktemp("abuse") / NAME, seed=5)
    with ServerProcess(str(d), "--threads", "1", "--generation",
                       "max_loras=1,allow_runtime_lora=true,engine_process=true") as srv:
        yield srv


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def _engine_restarts(srv) -> int:
    return srv.output(tail=1 << 22).count("engine process exited")


@pytest.mark.parametrize("extra", [
    {"bad_words": [f"w{i}" for i in range(60_000)]},  # their token sequences: ~1 MB pickled
    # a ~700 KB grammar within the structured-output limits (no long forced text, parser rows within llguidance's)
    {"guided_grammar": 'start: ("a" | "b")+\n' + "\n".join(f'r{i}: "a" | "b"' for i in range(40_000))},
], ids=["bad_words", "grammar"])
def test_a_request_larger_than_the_socket_buffer_keeps_the_engine(server, extra):
    before = _engine_restarts(server)
    r = _post(server, "/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 3, **extra})
    assert r.status_code == 200, r.text
    after = _post(server, "/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 3})
    assert after.status_code == 200, after.text
    assert _engine_restarts(server) == before, server.output(tail=4000)


@pytest.mark.parametrize("path", ["/tmp/a\x00b", "\x00"])
def test_a_lora_path_with_a_nul_byte_is_a_400(server, path):
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "nul", "lora_path": path})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lora_path"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_request_chat_template_is_refused_not_ignored(server, route):
    body = {"model": NAME, "messages": ASK, "max_tokens": 2,
            "chat_template": "{{ ''.__class__.__mro__ }}{{ messages[0].content }}"}
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template"
    assert "__mro__" not in r.text
    # its own template's variables stay the request's to set
    ok = _post(server, route, {"model": NAME, "messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"x": 1}})
    assert ok.status_code == 200, ok.text


def test_responses_truncation_of_thousands_of_turns_does_not_hold_the_server(server):
    """truncation 'auto' rendered the prompt once per dropped turn: 1,000 turns took 4 s of the event loop,
    20,000 (under 1 MB of body) would take it for most of an hour, every other client waiting. Now a
    handful of renders: the request is answered within the client's timeout (old code: far past it), from
    a conversation cut to fit the context."""
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"turn {k}"} for k in range(20_000)]
    r = httpx.post(server.url + "/v1/responses", json={"model": NAME, "input": turns, "truncation": "auto",
                                                      "max_output_tokens": 4, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["input_tokens"]
    assert 0 < used and used + 4 <= 256  # the tiny model's context
    # the longest suffix that fits: one more turn pair would not
    n = next(k for k in range(2, 200, 2)
             if _post(server, "/v1/responses", {"model": NAME, "input": turns[-k:], "max_output_tokens": 4,
                                                "temperature": 0}).status_code == 400) - 2
    same = _post(server, "/v1/responses", {"model": NAME, "input": turns[-n:], "max_output_tokens": 4,
                                           "temperature": 0}).json()
    assert same["usage"]["input_tokens"] == used and same["output"][0]["content"][0]["text"] == \
        r.json()["output"][0]["content"][0]["text"]


def test_a_stop_string_over_1024_characters_is_a_400(server):
    for route, body in (("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}),
                        ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        r = _post(server, route, {"model": NAME, "stop": ["x" * 1025], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        ok = _post(server, route, {"model": NAME, "stop": ["x" * 1024], **body})
        assert ok.status_code == 200, ok.text
    r = _post(server, "/v1/messages", {"model": NAME, "messages": ASK, "max_tokens": 2, "stop_sequences": ["x" * 1025]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_stored_responses_are_bounded_in_bytes(tmp_path_factory):
    """The Responses store kept 10,000 responses whatever their size (a reasoning input item is kept whole):
    2 MB bodies held 20 GB. Past --responses-store-bytes the least recently used go."""
    d = build_model("qwen2", tmp_path_factory.mktemp("store") / NAME, seed=5)
    pad = {"type": "reasoning", "summary": [], "encrypted_content": "x" * 60_000}  # ~120 KB a record (kept twice)
    with ServerProcess(str(d), "--threads", "1", "--responses-store-bytes", "300000") as srv:
        ids = []
        for _ in range(3):
            r = _post(srv, "/v1/responses", {"model": NAME, "input": [pad, {"role": "user", "content": "hi"}],
                                             "max_output_tokens": 2})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        got = [httpx.get(f"{srv.url}/v1/responses/{rid}", timeout=30).status_code for rid in ids]
        assert got == [404, 200, 200]


def test_a_truncated_response_is_continued_from_what_its_prompt_held(server):
    """A response whose prompt truncation 'auto' cut is stored with the context its prompt held, not the whole
    conversation: a chain of truncated requests of 2 MB each grew its record, and the render of every
    continuation, without bound. Its continuation's prompt is the one the whole conversation gives (a later
    start could not fit again); without truncation the continuation's prompt is near the context, not all 400
    turns."""
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"turn {k}"} for k in range(400)]
    first = _post(server, "/v1/responses", {"model": NAME, "input": turns, "truncation": "auto",
                                            "max_output_tokens": 4, "temperature": 0})
    assert first.status_code == 200, first.text
    answer = first.json()["output"][0]["content"][0]["text"]
    nxt = {"role": "user", "content": "next"}
    body = {"model": NAME, "max_output_tokens": 4, "temperature": 0}
    cont = _post(server, "/v1/responses", {**body, "input": [nxt], "truncation": "auto",
                                           "previous_response_id": first.json()["id"]})
    whole = _post(server, "/v1/responses", {**body, "truncation": "auto", "input": turns + [
        {"role": "assistant", "content": answer}, nxt]})
    assert cont.status_code == 200 and whole.status_code == 200, (cont.text, whole.text)
    assert cont.json()["usage"]["input_tokens"] == whole.json()["usage"]["input_tokens"]
    assert cont.json()["output"][0]["content"][0]["text"] == whole.json()["output"][0]["content"][0]["text"]
    # without truncation the continuation's prompt is what the first one held and its answer, a little over the
    # context at most (it was all 400 turns)
    plain = _post(server, "/v1/responses", {**body, "input": [nxt], "previous_response_id": first.json()["id"]})
    if plain.status_code != 200:
        assert plain.status_code == 400, plain.text
        assert int(re.search(r"prompt has (\d+) tokens", plain.json()["error"]["message"]).group(1)) < 300
