"""Anthropic's Messages API end to end: real `surge serve` processes with decoder models, called with the real
`anthropic` client (create, stream, parse, count_tokens; sync and async). Answers are transformers' greedy
answers to the same conversation rendered by the same chat template; guided answers are transformers' held
by llguidance (tests/guided_reference.py); tool calls are what the model's text says. (This client has no
sampling arguments of its own: `temperature` goes in `extra_body`, as a user of a local model sends it.)"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest

torch = pytest.importorskip("torch")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llguidance")

from surge.runtime.guided import guide_for  # noqa: E402
from surge.server.http.reasoning import split  # noqa: E402
from surge.server.http.tool_calls import parse as parse_calls  # noqa: E402
from tests.decoder_models import QWEN_TOOLS, build_model, load_hf  # noqa: E402
from tests.e2e.test_responses_server import greedy, prompt_ids  # noqa: E402
from tests.guided_reference import hf_guided  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.trained_models import (ASK, TOOL, THINK_ANSWER, THINK_ASK, THINKING, train_thinking_model,  # noqa: E402
                                  train_tool_model)

GREEDY = {"temperature": 0}
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "rain": {"type": "boolean"}},
          "required": ["city", "rain"], "additionalProperties": False}
ADD = {"name": "add", "description": "Add", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("anthropic") / "claude-local", seed=11, vocab=512,
                       all_bytes=True, template=QWEN_TOOLS, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "tool_call_parser=hermes") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def stop_of(out: list[int], n: int, eos: int) -> str:
    return "end_turn" if out and out[-1] == eos else ("max_tokens" if len(out) == n else "end_turn")


def test_a_message_equals_transformers_whole_streamed_and_async(client, server, hf):
    eos = hf[0].config.eos_token_id
    system, user = "You are terse.", {"role": "user", "content": "Define assignment."}
    text, out, ids = greedy(hf, [{"role": "system", "content": system}, user], 24)
    m = client.messages.create(model="claude-local", system=system, messages=[user], max_tokens=24, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    # as Anthropic counts them, the prompt's tokens found in the prefix cache are not input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids) and m.usage.output_tokens == len(out)
    assert m.stop_reason == stop_of(out, 24, eos) and m.stop_sequence is None

    with client.messages.stream(model="claude-local", system=[{"type": "text", "text": system}], messages=[user],
                                max_tokens=24, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == len(out)
    # the same greedy request again: answered from the generation cache, no prompt token computed
    assert final.usage.cache_read_input_tokens == len(ids) and final.usage.input_tokens == 0

    asks = ["What is a loop?", "Name a list.", "Define assignment."]
    refs = [greedy(hf, [{"role": "user", "content": a}], 12)[0] for a in asks]

    async def together():
        async with anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(c.messages.create(model="claude-local", max_tokens=12, extra_body=GREEDY,
                                                            messages=[{"role": "user", "content": a}]) for a in asks))

    assert [r.content[0].text for r in asyncio.run(together())] == refs


def test_stop_sequences_and_count_tokens(client, hf):
    full, _, _ = greedy(hf, [{"role": "user", "content": "Define assignment."}], 30)
    # a piece of the answer that first appears after its start (the random model writes few spaces)
    word = next(full[k:k + 2] for k in range(2, len(full) - 2)
                if full.index(full[k:k + 2]) == k and "\ufffd" not in full[k:k + 2])
    m = client.messages.create(model="claude-local", messages=[{"role": "user", "content": "Define assignment."}],
                               max_tokens=30, stop_sequences=["\x00never", word], extra_body=GREEDY)
    assert m.content[0].text == full[:full.index(word)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": [{"type": "text", "text": "Define "}, {"type": "text", "text": "it."}]}]
    counted = client.messages.count_tokens(model="claude-local", system="Be brief.", messages=conversation)
    want = [{"role": "system", "content": "Be brief."}, conversation[0], conversation[1],
            {"role": "user", "content": "Define it."}]
    assert counted.input_tokens == len(prompt_ids(hf, want))


def test_output_format_json_schema_and_parse(client, hf, model_dir):
    import jsonschema
    import pydantic

    model, tok = hf
    m = client.messages.create(model="claude-local", messages=ASK, max_tokens=60, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    want = tok.decode(hf_guided(model, model_dir, prompt_ids(hf, ASK), guide_for("json", SCHEMA, "x"), 60),
                      skip_special_tokens=True)
    assert m.content[0].text == want and m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(want), SCHEMA)

    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        rain: bool

    parsed = client.messages.parse(model="claude-local", messages=ASK, max_tokens=60, output_format=Weather,
                                   extra_body=GREEDY)
    assert isinstance(parsed.parsed_output, Weather)


def test_a_named_tool_choice_gives_tool_use_blocks(client):
    m = client.messages.create(model="claude-local", messages=ASK, max_tokens=60, tools=[ADD],
                               tool_choice={"type": "tool", "name": "add"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    assert m.content[0].name == "add" and 0 <= m.content[0].input["a"] <= 9 and m.content[0].id.startswith("toolu_")


def test_what_surge_cannot_do_is_refused_in_anthropics_shape(client, server):
    import httpx

    cases = [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"tool_choice": {"type": "any"}},
        {"output_config": {"effort": "high"}},
        {"thinking": {"type": "sometimes"}},
        {"extra_body": {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}},  # a beta field
    ]
    for extra in cases:
        body = {"model": "claude-local", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], **extra}
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(**body)
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(server.url + "/v1/messages", json={"model": "claude-local", "messages": []}, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request_error"


def test_tool_use_and_its_result_continue_the_conversation(tmp_path_factory):
    model_dir = train_tool_model(tmp_path_factory.mktemp("anthtool") / "tool-qwen")
    hf = load_hf(model_dir)
    tool = {"name": TOOL["function"]["name"], "description": TOOL["function"]["description"],
            "input_schema": TOOL["function"]["parameters"]}
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "tool_call_parser=hermes") as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)
        m = client.messages.create(model="tool-qwen", messages=ASK, tools=[tool], max_tokens=60, extra_body=GREEDY)
        assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
        assert m.content[0].text == "Checking."
        use = m.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Paris"}
        with client.messages.stream(model="tool-qwen", messages=ASK, tools=[tool], max_tokens=60,
                                    extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("text", None),
                                                                                ("tool_use", {"city": "Paris"})]
        assert final.stop_reason == "tool_use"
        turns = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]
        m2 = client.messages.create(model="tool-qwen", messages=turns, tools=[tool], max_tokens=20, extra_body=GREEDY)
    chat = [*ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "Sunny"}]
    text, _, ids = greedy(hf, chat, 20, tools=[TOOL])
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == len(ids)
    content, calls = parse_calls(text)
    assert "".join(b.text for b in m2.content if b.type == "text") == (content or "")
    assert [(b.name, b.input) for b in m2.content if b.type == "tool_use"] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_thinking_blocks_and_an_api_key_in_x_api_key(tmp_path_factory):
    model_dir = train_thinking_model(tmp_path_factory.mktemp("anththink") / "think-qwen")
    assert greedy(load_hf(model_dir), THINK_ASK, 60)[0] == THINK_ANSWER
    _, content = split(THINK_ANSWER, "deepseek_r1")
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "reasoning_parser=deepseek_r1",
                       "--api-key", "sekrit") as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="sekrit", max_retries=0, timeout=120)
        m = client.messages.create(model="think-qwen", messages=THINK_ASK, max_tokens=60, extra_body=GREEDY)
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert m.content[0].thinking == THINKING and m.content[1].text == content and m.stop_reason == "end_turn"
        with client.messages.stream(model="think-qwen", messages=THINK_ASK, max_tokens=60, extra_body=GREEDY) as s:
            events = list(s)
            final = s.get_final_message()
        thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                           and e.delta.type == "thinking_delta")
        assert thinking == THINKING and [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[1].text == content
        wrong = anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0, timeout=120)
        with pytest.raises(anthropic.AuthenticationError) as info:
            wrong.messages.create(model="think-qwen", messages=THINK_ASK, max_tokens=2)
        assert info.value.body["error"]["type"] == "authentication_error"
