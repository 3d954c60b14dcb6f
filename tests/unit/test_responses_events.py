"""server/http/responses_events.py and responses_items.py: a response's items are the same whether its
text arrives at once or in any pieces; each streamed item is announced, filled and closed in order; the
Responses API's input items become the chat messages transformers renders."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from surge.errors import InvalidInput
from surge.server.http.responses_events import ResponseEvents
from surge.server.http.responses_items import (choice_for_chat, normalize_input, text_format, to_messages,
                                               tools_for_chat)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "<think>\nWeather, so a call.\n</think>\n\nChecking." + CALL + "\n" + CALL.replace("Paris", "Rome") + " Done.",
    "<think>Only thinking, cut off",
    "Plain answer, no tags at all.",
    CALL + "\n\n",
    "",
    "   ",
    "<think>x</think>" + CALL,
]


def prepared(reasoning="deepseek_r1", parse_calls="hermes", want_lps=False):
    return SimpleNamespace(base={"id": "resp_1", "object": "response", "status": "in_progress"}, want_lps=want_lps,
                           parse_calls=parse_calls, forced=False, reasoning=reasoning, count=lambda text: text.split())


def run(p, pieces, logprobs=None):
    ev = ResponseEvents(p)
    raw = ev.start()
    for k, piece in enumerate(pieces):
        raw += ev.delta(SimpleNamespace(text=piece, logprobs=None if logprobs is None else logprobs[k]))
    raw += ev.finish(SimpleNamespace(finish_reason="stop", prompt_tokens=5, completion_tokens=9, cached_tokens=0))
    events = []
    for chunk in raw:
        head, data = chunk.decode().rstrip("\n").split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        events.append(event)
    return ev.response, events


def shape(items):
    """Items without their ids (new ones every time)."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def cuts(text: str, rng: random.Random) -> list[str]:
    marks = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *marks], [*marks, len(text)])]


@pytest.mark.parametrize("reasoning", ["none", "deepseek_r1"])
@pytest.mark.parametrize("parse_calls", [None, "hermes"])
def test_items_equal_however_the_text_is_cut_and_events_are_in_order(reasoning, parse_calls):
    rng = random.Random(7)
    for text in TEXTS:
        whole, _ = run(prepared(reasoning, parse_calls), [text])
        for _ in range(30):
            got, events = run(prepared(reasoning, parse_calls), cuts(text, rng))
            assert shape(got["output"]) == shape(whole["output"]), text
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
            # each item: added, its deltas, done, before the next item is added
            open_item, text_of = None, {}
            for e in events[2:-1]:
                if e["type"] == "response.output_item.added":
                    assert open_item is None
                    open_item = e["item"]["id"]
                    text_of[open_item] = ""
                elif e["type"].endswith((".delta",)):
                    assert e["item_id"] == open_item
                    text_of[open_item] += e["delta"]
                elif e["type"] == "response.output_item.done":
                    assert e["item"]["id"] == open_item
                    item = e["item"]
                    final = item.get("arguments") if item["type"] == "function_call" else item["content"][0]["text"]
                    assert text_of[open_item] == final
                    open_item = None
            assert open_item is None
            assert [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"] == \
                [item["id"] for item in got["output"]]


def test_the_items_say_what_the_parsers_say():
    from surge.server.http.reasoning import split
    from surge.server.http.tool_calls import parse

    response, _ = run(prepared(), [TEXTS[0]])
    kinds = [(i["type"], i.get("name")) for i in response["output"]]
    assert kinds == [("reasoning", None), ("message", None), ("function_call", "get_weather"),
                     ("function_call", "get_weather"), ("message", None)]
    thinking, content = split(TEXTS[0], "deepseek_r1")
    assert response["output"][0]["content"][0]["text"] == thinking
    _, calls = parse(content)
    assert [json.loads(i["arguments"]) for i in response["output"] if i["type"] == "function_call"] == \
        [json.loads(c["function"]["arguments"]) for c in calls]
    assert response["output"][1]["content"][0]["text"] == "\n\nChecking."
    assert response["output"][4]["content"][0]["text"] == " Done."
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == len(thinking.split())
    only, _ = run(prepared(), [TEXTS[1]])  # cut off while thinking: a reasoning item, no message
    assert [i["type"] for i in only["output"]] == ["reasoning"]
    blank, _ = run(prepared(reasoning="none"), ["   "])  # a blank answer is a message of it
    assert [(i["type"], i["content"][0]["text"]) for i in blank["output"]] == [("message", "   ")]
    calls_only, _ = run(prepared(reasoning="none"), [TEXTS[3]])
    assert [i["type"] for i in calls_only["output"]] == ["function_call"]


def test_logprobs_go_with_the_message_text():
    lp = [[{"token": "a", "logprob": -0.5, "top": [("a", -0.5, 1)]}], [{"token": "b", "logprob": -1.0, "top": []}]]
    response, events = run(prepared(reasoning="none", parse_calls=None, want_lps=True), ["a", "b"], lp)
    part = response["output"][0]["content"][0]
    assert [x["token"] for x in part["logprobs"]] == ["a", "b"]
    assert part["logprobs"][0]["top_logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97]}]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[x["token"] for x in e["logprobs"]] for e in deltas] == [["a"], ["b"]]


def test_input_items_become_chat_messages_as_transformers_renders_them():
    from transformers.utils.chat_template_utils import render_jinja_template

    from tests.decoder_models import QWEN_TOOLS

    items = normalize_input([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                    "text": "Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]},
        {"type": "reasoning", "summary": []},
    ])
    assert all(i["id"] for i in items)
    messages = to_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Weather in Paris?" and messages[1]["content"] == "Checking."
    assert [c["function"]["name"] for c in messages[1]["tool_calls"]] == ["get_weather", "get_weather"]
    tools = tools_for_chat([{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    want = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "content": "Sunny"}, {"role": "tool", "content": "Rain"}]
    from surge.models.chat_template import ChatTemplate

    ours = ChatTemplate(QWEN_TOOLS, {}).render(messages, tools=tools)  # arguments as objects there
    theirs, _ = render_jinja_template([want], chat_template=QWEN_TOOLS, tools=tools, add_generation_prompt=True)
    assert ours == theirs[0]
    assert '"arguments": {"city": "Rome"}' in ours  # an object, not a quoted string


def test_what_a_text_model_cannot_take_is_a_400():
    bad = [
        [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        [{"role": "robot", "content": "x"}],
        [{"type": "item_reference", "id": "msg_1"}],
        [{"type": "function_call", "name": "f", "arguments": "{}"}],
        [],
    ]
    for raw in bad:
        with pytest.raises(InvalidInput) as info:
            normalize_input(raw)
        assert info.value.param == "input"
    with pytest.raises(InvalidInput):
        tools_for_chat([{"type": "web_search"}])
    with pytest.raises(InvalidInput):
        choice_for_chat({"type": "allowed_tools", "tools": []})
    assert choice_for_chat({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert text_format({"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}) == \
        {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    with pytest.raises(InvalidInput):
        text_format({"format": {"type": "json_schema", "name": "w"}})


def test_system_and_developer_messages_join_into_one_leading_system_message():
    from surge.server.http.responses_items import system_first

    turns = [{"role": "system", "content": "Instructions."}, {"role": "user", "content": "Hi"},
             {"role": "developer", "content": "Be brief."}, {"role": "assistant", "content": "Ok."},
             {"role": "system", "content": ""}]
    assert system_first(turns) == [{"role": "system", "content": "Instructions.\n\nBe brief."},
                                   {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok."}]
    assert system_first([{"role": "user", "content": "Hi"}]) == [{"role": "user", "content": "Hi"}]
