"""server/http/anthropic_messages.py and anthropic_events.py: Anthropic's turns as the chat messages a
template renders, its tools and tool choices as chat's, and its stop reasons."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from surge.errors import InvalidInput
from surge.server.http.anthropic_events import MessageEvents, stop
from surge.server.http.anthropic_messages import AnthropicMessage, choice_for_chat, to_messages, tools_for_chat


def request(messages, system=None):
    return SimpleNamespace(system=system, messages=[AnthropicMessage(**m) for m in messages])


def test_turns_become_chat_messages():
    req = request([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "P"}},
                                          {"type": "tool_use", "id": "toolu_2", "name": "w", "input": {"c": "R"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sun"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": [{"type": "text", "text": "Rain"}]},
                                     {"type": "text", "text": "Thanks."}]},
    ], system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}])
    assert to_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "w", "arguments": {"c": "P"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "w", "arguments": {"c": "R"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sun"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Rain"},
        {"role": "user", "content": "Thanks."},
    ]
    only_results = request([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}])
    assert [m["role"] for m in to_messages(only_results)] == ["tool"]
    for bad in ([{"type": "image", "source": {}}], [{"type": "tool_use", "id": "t", "name": "n", "input": {}}],
                [{"type": "tool_result", "content": "x"}]):
        with pytest.raises(InvalidInput):
            to_messages(request([{"role": "user", "content": bad}]))


def test_tools_and_choices():
    tools = tools_for_chat([{"name": "w", "description": "d", "input_schema": {"type": "object"}},
                            {"type": "custom", "name": "v", "input_schema": {"type": "object"}}])
    assert tools[0] == {"type": "function", "function": {"name": "w", "description": "d",
                                                         "parameters": {"type": "object"}}}
    assert list(tools[0]["function"]) == ["name", "description", "parameters"]  # chat's order, as templates write it
    with pytest.raises(InvalidInput):
        tools_for_chat([{"type": "bash_20250124", "name": "bash"}])
    assert choice_for_chat({"type": "any"}) == ("required", None)
    assert choice_for_chat({"type": "auto", "disable_parallel_tool_use": True}) == ("auto", False)
    assert choice_for_chat({"type": "tool", "name": "w"}) == ({"type": "function", "function": {"name": "w"}}, None)
    with pytest.raises(InvalidInput):
        choice_for_chat({"type": "tool"})


def test_stop_reasons_and_blocks():
    assert stop("stop", None, False) == ("end_turn", None)
    assert stop("stop", "END", False) == ("stop_sequence", "END")
    assert stop("stop", 7, False) == ("end_turn", None)  # a stop token id is the end of a turn
    assert stop("length", None, False) == ("max_tokens", None)
    assert stop("stop", None, True) == ("tool_use", None)
    assert stop("length", None, True) == ("max_tokens", None)  # Anthropic's whenever the limit was hit
    base = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "usage": {"input_tokens": 3, "output_tokens": 0}}
    ev = MessageEvents(base, "deepseek_r1", "hermes")
    ev.delta(SimpleNamespace(text='<think>a</think>Hi<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>'))
    ev.finish(SimpleNamespace(finish_reason="stop", stop_reason=None, completion_tokens=9, cached_tokens=2))
    assert [(b["type"], b.get("thinking") or b.get("text") or b.get("input")) for b in ev.message["content"]] == \
        [("thinking", "a"), ("text", "Hi"), ("tool_use", {"c": 1})]
    assert ev.message["stop_reason"] == "tool_use" and ev.message["usage"]["output_tokens"] == 9
    assert ev.message["usage"]["input_tokens"] == 1 and ev.message["usage"]["cache_read_input_tokens"] == 2
