"""Hermes tool calls read from a chat answer (server/http/tool_calls.py), whole and streamed in random
pieces: the same content and calls either way."""

from __future__ import annotations

import json
import random

import pytest

from surge.server.http.tool_calls import parse
from surge.server.http.tool_parsers.hermes import HermesStream as ToolCallStream

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
CASES = [
    ("Let me check.\n" + CALL, "Let me check.\n", [("get_weather", {"city": "Paris", "unit": "°C"})]),
    (CALL + "\n" + CALL.replace("Paris", "Oslo"), None,
     [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_weather", {"city": "Oslo", "unit": "°C"})]),
    ("no calls at all, a < sign and <tool", "no calls at all, a < sign and <tool", []),
    ("<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", []),
    ('<tool_call>["a list"]</tool_call>', '<tool_call>["a list"]</tool_call>', []),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [("f", {"x": 1})]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    ("an unclosed <tool_call>{\"name\": \"f\"", "an unclosed <tool_call>{\"name\": \"f\"", []),
    ("", "", []),
]


def _plain(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_answers(text, content, calls):
    got_content, got_calls = parse(text)
    assert got_content == content
    assert _plain(got_calls) == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_streamed_in_random_pieces_equals_whole(text, content, calls):
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = ToolCallStream()
        out = [x for p in pieces for x in stream.feed(p)] + [(stream.finish(), None)]
        streamed_text = "".join(t for t, _ in out if t)
        # whole answers with only calls have no content; a stream passes their whitespace on
        assert streamed_text == content if content is not None else not streamed_text.strip()
        emitted = [c for _, c in out if c]
        assert [i for i, _ in emitted] == list(range(len(calls)))
        assert _plain([c for _, c in emitted]) == calls
        # nothing that could start a call is let out early
        for t, _ in out:
            assert not t or "<tool_call>" not in t or not calls


def test_a_partial_open_tag_is_held_until_known():
    s = ToolCallStream()
    assert s.feed("Hi <tool") == [("Hi ", None)]
    assert s.feed("box> ok") == [("<toolbox> ok", None)]
    assert s.feed(" <tool_") == [(" ", None)]
    assert s.finish() == "<tool_"
