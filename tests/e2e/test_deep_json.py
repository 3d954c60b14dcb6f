"""Deeply nested JSON in a request is a 4xx, never a 500 or a dropped connection.

orjson parses JSON nested up to 1024 levels, and the generation routes hand parts of a body (a JSON
schema, tool parameters, a tool call's arguments) to code that recurses in Python (json.dumps when a
schema becomes a guide, the chat template's `tojson`, json.loads of a schema or of arguments sent as a
string), which raised RecursionError from ~990 levels: a 500 with a traceback in the log per request,
and on some routes no answer at all. Now a request body, or JSON sent inside one as a string, nested
deeper than surge's limit (surge/json_depth.py) is refused before any of that runs.

Against a real `surge serve` of a tiny decoder, with raw JSON bodies (a JSON encoder in the test
recurses too).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.decoder_models import build_model
from tests.server_process import ServerProcess

DEPTH = 1000  # within what orjson parses, beyond what Python's recursion takes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("deep") / "deep-qwen", seed=3, vocab=512, all_bytes=True)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "tool_call_parser=hermes", grpc=False) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"content-type": "application/json"}) as c:
        yield c


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def as_string(depth: int) -> bytes:  # the same, as a JSON string inside the body
    return json.dumps(nested(depth).decode()).encode()


CHAT = b'{"model":"deep-qwen","messages":[{"role":"user","content":"hi"}],"max_tokens":2,'
CASES = {
    "guided_json": ("/v1/chat/completions", lambda d: CHAT + b'"guided_json":' + nested(d) + b"}"),
    "guided_json as a string": ("/v1/chat/completions", lambda d: CHAT + b'"guided_json":' + as_string(d) + b"}"),
    "response_format": ("/v1/chat/completions", lambda d: CHAT + b'"response_format":{"type":"json_schema",'
                        b'"json_schema":{"name":"x","schema":' + nested(d) + b"}}}"),
    "tool parameters": ("/v1/chat/completions", lambda d: CHAT + b'"tools":[{"type":"function","function":'
                        b'{"name":"f","parameters":' + nested(d) + b"}}]}"),
    "anthropic tools": ("/v1/messages", lambda d: CHAT + b'"tools":[{"name":"f","input_schema":' + nested(d) + b"}]}"),
    "responses text format": ("/v1/responses", lambda d: b'{"model":"deep-qwen","input":"hi","max_output_tokens":2,'
                              b'"text":{"format":{"type":"json_schema","name":"x","schema":' + nested(d) + b"}}}"),
    "responses tools": ("/v1/responses", lambda d: b'{"model":"deep-qwen","input":"hi","max_output_tokens":2,'
                        b'"tools":[{"type":"function","name":"f","parameters":' + nested(d) + b"}]}"),
    "tokenize with tools": ("/tokenize", lambda d: b'{"model":"deep-qwen","messages":[{"role":"user","content":"hi"}],'
                            b'"tools":[{"type":"function","function":{"name":"f","parameters":' + nested(d) + b"}}]}"),
    "kserve generate": ("/v2/models/deep-qwen/generate", lambda d: b'{"text_input":"hi","parameters":{"max_tokens":2,'
                        b'"guided_json":' + nested(d) + b"}}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deep_nesting_is_a_client_error(server, client, case):
    path, body = CASES[case]
    r = client.post(path, content=body(DEPTH))
    assert r.status_code in (400, 413, 422), (r.status_code, r.text[:300])
    assert "nested" in r.text, r.text[:300]
    assert "RecursionError" not in server.output(tail=1 << 20)


def test_deep_tool_call_arguments_stay_the_string_they_were(server, client):
    """Arguments sent as a string are decoded for the chat template when they are a JSON object; too deep,
    they are kept as the string, as arguments that are not JSON are (before: json.loads recursed, a 500)."""
    r = client.post("/v1/chat/completions", content=(
        b'{"model":"deep-qwen","max_tokens":2,"messages":[{"role":"user","content":"hi"},{"role":"assistant",'
        b'"content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":'
        + as_string(DEPTH) + b'}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}]}'))
    assert r.status_code in (200, 400), (r.status_code, r.text[:300])  # 400: the prompt is longer than the model
    assert "RecursionError" not in server.output(tail=1 << 20)


def test_ordinary_nesting_still_works(client, model_dir):
    """A schema 20 objects deep is plainly valid: it compiles, and the answer is held to it (transformers'
    greedy `generate` held to the same schema by llguidance is the reference)."""
    from tests.decoder_models import load_hf
    from tests.guided_reference import hf_guided

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "x-deep": json.loads(nested(20))}
    r = client.post("/v1/chat/completions", content=CHAT.replace(b'"max_tokens":2', b'"max_tokens":12')
                    + b'"temperature":0,"guided_json":' + json.dumps(schema).encode() + b"}")
    assert r.status_code == 200, r.text[:300]
    model, tok = load_hf(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    want = tok.decode(hf_guided(model, model_dir, ids, ("json", json.dumps(schema)), 12), skip_special_tokens=True)
    assert r.json()["choices"][0]["message"]["content"] == want and want.lstrip().startswith("{"), (r.text, want)
