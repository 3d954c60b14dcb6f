"""runtime/off_loop.py: a generation request's preparation (parsing, validation, the chat template's render,
tokenization, bad words, logit bias, a guide's compile, the engine message) runs on a preparation thread for
a large request; its answer and its errors are those of the same request prepared on the event loop.

A real uvicorn server running the real app in this process (as tests/integration/test_generate_hotpath.py;
the engine loop in its own process, the default) with a tiny random decoder. Each request is sent with the
thresholds patched both ways, everything on the event loop (the old behaviour) and everything on threads,
through the hot path and through the routes (a chunked body): same status, same bytes apart from ids and
timestamps. Where the work ran is read off the threads the tokenizer was called on (no timing).
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from surge.runtime import generate_service, off_loop
from surge.runtime.generate_text import PromptText
from tests.decoder_models import build_model
from tests.integration.test_direct_http import InProcessServer
from tests.integration.test_generate_hotpath import normalized

pytestmark = pytest.mark.timeout(600)

ASK = [{"role": "user", "content": "Define it."}]
PAD = [f"qz{i}" for i in range(3000)]  # bad words of a large request (~30 KB)
TURNS = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"turn {k}"} for k in range(9)]
GRAMMAR = ("start: " + " ".join(f"r{i}" for i in range(4000)) + "\n"
           + "\n".join(f'r{i}: "a" | "b"' for i in range(4000)))  # over guided.CACHED_CHARS
BIAS = {str(t).zfill(w): -1.5 for w in range(1, 7) for t in range(0, 384, 2)}  # 1,152 entries ("7", "07", ...)
GREEDY = {"model": "m", "temperature": 0, "ignore_eos": True}


def cases(word: str) -> list[tuple[str, dict]]:
    bad = [word, *PAD]
    return [
        ("/v1/chat/completions", {**GREEDY, "messages": ASK, "max_tokens": 12, "bad_words": bad}),
        ("/v1/chat/completions", {**GREEDY, "messages": ASK, "max_tokens": 8, "bad_words": bad, "stream": True,
                                  "n": 2, "seed": 4, "temperature": 0.9}),
        ("/v1/completions", {**GREEDY, "prompt": "The target", "max_tokens": 12, "bad_words": bad}),
        ("/v1/completions", {**GREEDY, "prompt": ["The target", "Loops"], "max_tokens": 6, "logit_bias": BIAS,
                             "echo": True, "logprobs": 1}),
        ("/v1/completions", {**GREEDY, "prompt": "The", "max_tokens": 6, "guided_grammar": GRAMMAR}),
        ("/v1/chat/completions", {**GREEDY, "messages": TURNS, "max_tokens": 8, "stop": ["x" * 1000] * 16}),
        ("/v1/responses", {**GREEDY, "input": TURNS * 3, "max_output_tokens": 6, "truncation": "auto"}),
        ("/v1/messages", {**GREEDY, "messages": TURNS, "max_tokens": 6, "stream": True}),
        ("/v2/models/m/generate", {"text_input": "The target", "parameters": {"max_tokens": 8, "temperature": 0,
                                                                             "bad_words": bad}}),
        # bad input: the same errors
        ("/v1/chat/completions", {**GREEDY, "messages": ASK, "bad_words": [*PAD, ""]}),
        ("/v1/completions", {**GREEDY, "prompt": "The", "logit_bias": {**BIAS, "x": 1}}),
        ("/v1/completions", {**GREEDY, "prompt": "The", "logit_bias": {**BIAS, "384": 1}}),
        ("/v1/completions", {**GREEDY, "prompt": "The", "guided_grammar": GRAMMAR + "\nbroken"}),
        ("/v1/chat/completions", {**GREEDY, "messages": TURNS * 30, "bad_words": bad}),  # longer than the context
        ("/v1/chat/completions", {**GREEDY, "messages": ASK, "bad_words": bad, "max_tokens": 2, "min_tokens": 3}),
        ("/v1/completions", {**GREEDY, "prompt": [7] * 5000}),
        ("/v1/messages", {**GREEDY, "messages": TURNS * 30, "max_tokens": 4}),
        ("/v2/models/m/generate", {"text_input": "The", "bad_words": bad, "parameters": {"max_tokens": 0}}),
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = build_model("qwen2", tmp_path_factory.mktemp("offloop") / "m", seed=7, hidden_size=128)
    with InProcessServer(model_dir=str(d), model_name="m", engine={"threads": 1}) as srv:
        yield srv


@pytest.fixture
def encoded_on(monkeypatch):
    """The names of the threads the tokenizer encoded on."""
    names: list[str] = []
    encode = PromptText.encode

    def spy(self, text, **kw):
        names.append(threading.current_thread().name)
        return encode(self, text, **kw)

    monkeypatch.setattr(PromptText, "encode", spy)
    return names


def _chunks(data: bytes):
    yield data[:7]
    yield data[7:]


def _send(srv, path: str, body: dict, route: bool, raw: bool = False) -> tuple[int, bytes]:
    """(status, body): `raw` as it came, else without ids and times (normalized)."""
    data = json.dumps(body).encode()
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=120) as c:
        r = c.post(path, content=_chunks(data) if route else data, headers={"Content-Type": "application/json"})
        return r.status_code, r.content if raw else normalized(r.content, path)


async def _here(fn, *args):
    return fn(*args)


def _answers(srv, monkeypatch, threaded: bool, requests, route: bool, raw: bool = False) -> list:
    """Every request's answer, prepared all on threads (`threaded`) or all on the event loop (as before)."""
    with monkeypatch.context() as m:
        if threaded:
            m.setattr(off_loop, "OFF_LOOP_BYTES", -1)
            m.setattr(generate_service, "BULK", -1)
        else:
            m.setattr(off_loop, "off_loop", _here)
            m.setattr(generate_service, "off_loop", _here)
        return [_send(srv, path, body, route, raw) for path, body in requests]


@pytest.mark.parametrize("route", [False, True], ids=["hot_path", "routes"])
def test_large_requests_prepared_on_threads_answer_as_on_the_loop(server, monkeypatch, encoded_on, route):
    plain = _send(server, "/v1/completions", {**GREEDY, "prompt": "The target", "max_tokens": 12}, route)
    word = next(w for w in json.loads(plain[1])["choices"][0]["text"].split() if len(w) > 2)
    requests = cases(word)
    inline = _answers(server, monkeypatch, False, requests, route)
    assert not any(name.startswith("surge-prepare") for name in encoded_on)
    encoded_on.clear()
    threaded = _answers(server, monkeypatch, True, requests, route)
    # every prompt and bad word was tokenized on a preparation thread
    assert encoded_on and all(name.startswith("surge-prepare") for name in encoded_on), set(encoded_on)
    for (path, _), a, b in zip(requests, inline, threaded, strict=True):
        assert a == b, (path, a[0], b[0], a[1][:300], b[1][:300])
    statuses = [status for status, _ in inline]
    assert statuses[:9] == [200] * 9 and all(s in (400, 422) for s in statuses[9:]), [(s, b[:200]) for s, b in inline]
    # the banned word is not written (the bad words took effect) where the plain answer wrote it
    assert word not in json.loads(inline[2][1])["choices"][0]["text"]


def _infer_body(sampling: dict) -> dict:
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["The target"]},
                       {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1],
                        "data": [json.dumps(sampling)]}]}


LONG = "The target of the loops. " * 400  # 10 KB: over OFF_LOOP_BYTES
TOKENIZER_CASES = [
    ("/tokenize", {"model": "m", "prompt": LONG, "return_token_strs": True}),
    ("/tokenize", {"model": "m", "messages": TURNS * 60, "add_generation_prompt": True}),
    ("/tokenize", {"model": "m", "inputs": [LONG, "Loops"]}),  # TEI's body
    ("/detokenize", {"model": "m", "tokens": [7, 0, 41] * 3000}),
    ("/decode", {"model": "m", "ids": [[7, 0, 41] * 2000, [9] * 10], "skip_special_tokens": False}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": TURNS * 60, "system": LONG}),
    ("/v2/models/m/infer", _infer_body({"bad_words": PAD, "max_tokens": 8, "temperature": 0})),
    ("/v2/models/m/infer", {**_infer_body({"max_tokens": 6, "temperature": 0, "guided_choice": ["yes", "no"]}),
                            "outputs": [{"name": "text_output"}]}),
    # bad input: the same errors
    ("/tokenize", {"model": "m", "messages": TURNS * 60, "chat_template": "{{ messages }}"}),  # vLLM's error shape
    ("/tokenize", {"model": "m", "messages": TURNS * 60, "add_generation_prompt": True,
                   "continue_final_message": True}),
    ("/detokenize", {"model": "m", "tokens": [7] * 5000 + [384]}),
    ("/decode", {"model": "m", "ids": [[7] * 5000, []]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": TURNS * 60, "tool_choice": {"type": "bogus"}}),
    ("/v2/models/m/infer", _infer_body({"bad_words": PAD, "max_tokens": 1, "min_tokens": 2})),
    ("/v2/models/m/infer", _infer_body({"bad_words": PAD, "guided_regex": "("})),
]


@pytest.mark.parametrize("route", [False, True], ids=["declared_length", "chunked"])
def test_tokenizer_routes_and_kserve_infer_prepared_on_threads_answer_as_on_the_loop(server, monkeypatch,
                                                                                     encoded_on, route):
    inline = _answers(server, monkeypatch, False, TOKENIZER_CASES, route, raw=True)
    assert not any(name.startswith("surge-prepare") for name in encoded_on)
    encoded_on.clear()
    threaded = _answers(server, monkeypatch, True, TOKENIZER_CASES, route, raw=True)
    # count_tokens' and the KServe infer's prompts were tokenized on preparation threads
    assert encoded_on and all(name.startswith("surge-prepare") for name in encoded_on), set(encoded_on)
    for (path, _), a, b in zip(TOKENIZER_CASES, inline, threaded, strict=True):
        assert a == b, (path, a[0], b[0], a[1][:300], b[1][:300])
    statuses = [status for status, _ in inline]
    assert statuses[:8] == [200] * 8 and all(s in (400, 422) for s in statuses[8:]), \
        [(s, b[:200]) for s, b in inline]
