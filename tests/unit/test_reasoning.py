"""Reasoning parsers (server/http/reasoning.py, vLLM's deepseek_r1 and qwen3): a whole answer's
(reasoning, content), the same streamed in random pieces, the chat message and stream deltas with tool
calls in the content, and a structured output's grammar held until the end of the thinking
(runtime/guided.py after_reasoning) on a real llguidance matcher."""

from __future__ import annotations

import json
import random

import pytest

from surge.server.http.reasoning import ChatDeltas, ReasoningStream, message, request_parser, split

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# (answer, (reasoning, content)) under deepseek_r1 and qwen3 (the same rules; qwen3's differ only by request)
CASES = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", ("\nThe user greets me.\n", "\n\nHello!")),
    ("The prompt opened it.</think>Answer.", ("The prompt opened it.", "Answer.")),
    ("  \n<think>leading space</think>x", ("leading space", "x")),
    ("<think>cut off while thinking", ("cut off while thinking", None)),
    ("no tags at all", ("no tags at all", None)),
    ("<think>done</think>", ("done", None)),
    ("<think></think>only answer", ("", "only answer")),
    ("a </thin < </think> b </think> c", ("a </thin < ", " b </think> c")),
    ("text then <think>inner</think>after", ("text then <think>inner", "after")),
    ("<thinking>not the tag</think>y", ("<thinking>not the tag", "y")),
    ("<think", ("<think", None)),
    ("  <thi", ("  <thi", None)),
    ("why </thi", ("why </thi", None)),
    ("", ("", None)),
    ("é 思考 </think> ответ", ("é 思考 ", " ответ")),
]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text,want", CASES)
def test_whole_answers(parser, text, want):
    assert split(text, parser) == want


def test_no_parser_keeps_everything_in_content_and_unknown_parsers_fail():
    assert split("<think>a</think>b", "none") == (None, "<think>a</think>b")
    with pytest.raises(ValueError, match="deepseek_r1"):
        split("x", "granite")
    with pytest.raises(ValueError):
        ReasoningStream("granite")


def test_qwen3_with_thinking_turned_off_is_all_content():
    assert request_parser("qwen3", {"enable_thinking": False}) == "none"
    assert request_parser("qwen3", {"enable_thinking": True}) == "qwen3"
    assert request_parser("qwen3", None) == "qwen3"
    assert request_parser("deepseek_r1", {"enable_thinking": False}) == "deepseek_r1"


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _streamed(text: str, parser: str, pieces: list[str]) -> tuple[str, str, list]:
    stream = ReasoningStream(parser)
    out = [x for p in pieces for x in stream.feed(p)] + stream.finish()
    return ("".join(p for f, p in out if f == "reasoning"), "".join(p for f, p in out if f == "content"), out)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3", "none"])
@pytest.mark.parametrize("text", [t for t, _ in CASES] + ["<think>x</think>" + CALL, "<think>" * 3 + "</think>" * 3])
def test_streamed_in_random_pieces_equals_whole(parser, text):
    rng = random.Random(hash((text, parser)) & 0xFFFF)
    reasoning, content = split(text, parser)
    for _ in range(40):
        got_r, got_c, out = _streamed(text, parser, _pieces(text, rng))
        assert (got_r, got_c) == (reasoning or "", content or "")
        assert all(piece for _, piece in out)  # no empty pieces
        fields = [f for f, _ in out]
        assert fields == sorted(fields, key=lambda f: f != "reasoning")  # reasoning first, then content


def test_a_tail_that_may_start_a_tag_is_held_until_known():
    s = ReasoningStream("deepseek_r1")
    assert s.feed("  ") == [] and s.feed("<thi") == []  # may still be a leading <think>
    assert s.feed("nk>I think") == [("reasoning", "I think")]
    assert s.feed(" </th") == [("reasoning", " ")]
    assert s.feed("ink") == []
    assert s.feed("> so: 4") == [("content", " so: 4")]
    assert s.feed("</think>") == [("content", "</think>")]  # after the thinking, tags are text
    assert s.finish() == []
    s = ReasoningStream("deepseek_r1")
    assert s.feed("Hmm <") == [("reasoning", "Hmm ")]
    assert s.feed("b>") == [("reasoning", "<b>")]
    assert s.feed("</") == [] and s.finish() == [("reasoning", "</")]


def test_the_message_reads_tool_calls_from_the_content_only():
    text = "<think>I need the weather. <tool_call>{not json}</tool_call></think>Checking." + CALL
    msg, called = message(text, "deepseek_r1", parse_calls="hermes")
    assert called and msg["reasoning"] == "I need the weather. <tool_call>{not json}</tool_call>"
    assert msg["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    # a call inside the thinking is not a call
    msg, called = message("<think>" + CALL, "deepseek_r1", parse_calls="hermes")
    assert not called and msg == {"role": "assistant", "content": None, "reasoning": CALL}
    msg, called = message(text, "none", parse_calls=None)
    assert msg == {"role": "assistant", "content": text} and not called
    msg, _ = message("<think>a</think>b", "qwen3", parse_calls=None, include_reasoning=False)
    assert msg == {"role": "assistant", "content": "b"}


@pytest.mark.parametrize("parse_calls", [None, "hermes"])
def test_streamed_deltas_equal_the_whole_message(parse_calls):
    text = "<think>Weather wanted.</think>Checking." + CALL + " done"
    want, called = message(text, "deepseek_r1", parse_calls)
    rng = random.Random(7)
    for _ in range(30):
        deltas = ChatDeltas("deepseek_r1", parse_calls)
        pieces = _pieces(text, rng)
        out = [d for k, p in enumerate(pieces) for d in deltas.feed(p, final=k == len(pieces) - 1)]
        if not pieces:
            out = deltas.feed("", final=True)
        assert "".join(d.get("reasoning", "") for d in out) == want["reasoning"]
        assert "".join(d.get("content", "") for d in out) == (want["content"] or "")
        calls = [tc for d in out for tc in d.get("tool_calls", [])]
        assert [tc["function"]["arguments"] for tc in calls] == \
            [c["function"]["arguments"] for c in want.get("tool_calls", [])]
        assert deltas.called == called == (parse_calls is not None)


def test_a_structured_output_starts_after_the_end_of_thinking_token():
    """The wrapped grammar on llguidance's real matcher: anything (tags spelled in text too) until the
    `</think>` token, then only the schema's JSON; without the wrap the thinking itself is refused."""
    pytest.importorskip("llguidance")
    from surge.runtime.guided import Guides, after_reasoning
    from tests.decoder_models import train_tokenizer

    tok = train_tokenizer()
    tok.add_tokens(["<think>", "</think>", "{", "}", "\n"])
    eos = tok.token_to_id("<|im_end|>")
    guides = Guides(tok.to_str(), tok.get_vocab_size(), [eos])
    end = tok.token_to_id("</think>")
    assert guides.literal("</think>") == f"<[{end}]>"
    schema = ("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))

    def run(guide, text):
        m = guides.matcher(guide)
        for t in tok.encode(text, add_special_tokens=False).ids:
            if not m.consume(t):
                return "refused"
        return "accepting" if m._m.is_accepting() else "open"

    wrapped = after_reasoning(schema, end)
    guides.check(wrapped, "response_format")
    assert run(wrapped, 'a b </thin <think> x {"a": "no"}</think>{"a": 12}') == "accepting"
    assert run(wrapped, "still thinking") == "open"
    assert run(wrapped, "done</think>plain text") == "refused"
    assert run(schema, "<think>x</think>") == "refused"
    for inner, answer in [(("regex", "[0-9]+"), "42"), (("choice", json.dumps(["yes", "no"])), "no"),
                          (("grammar", 'start: "a" "b"'), "ab")]:
        g = after_reasoning(inner, end)
        guides.check(g, "structured_outputs")
        assert run(g, "hmm</think>" + answer) == "accepting"
        assert run(g, "hmm</think>z") == "refused"


@pytest.mark.parametrize("think_tokens", [True, False])
def test_a_model_without_a_think_token_refuses_a_structured_output_with_the_parser(think_tokens):
    """The front end's PromptText (the real tokenizer side of a served model): the wrapped guide where
    `</think>` is a token, else 400 naming the request's field."""
    pytest.importorskip("llguidance")
    from types import SimpleNamespace

    from surge.errors import InvalidInput
    from surge.runtime.generate_text import PromptText
    from surge.runtime.guided import after_reasoning
    from surge.server.http.reasoning import guide_after_thinking
    from tests.decoder_models import train_tokenizer

    tok = train_tokenizer()
    if think_tokens:
        tok.add_tokens(["<think>", "</think>"])

    class Text(PromptText):
        name, tokenizer, vocab_size = "m", tok, tok.get_vocab_size()

    req = SimpleNamespace(response_format=None, guided_json=None, guided_regex=None, guided_choice=["a", "b"],
                          guided_grammar=None, structured_outputs=None)
    guide = ("choice", json.dumps(["a", "b"]))
    if think_tokens:
        assert guide_after_thinking(guide, Text(), req, False) == after_reasoning(guide, tok.token_to_id("</think>"))
    else:
        with pytest.raises(InvalidInput, match="no </think> token") as e:
            guide_after_thinking(guide, Text(), req, False)
        assert e.value.param == "guided_choice"
        with pytest.raises(InvalidInput) as e:
            guide_after_thinking(guide, Text(), req, True)
        assert e.value.param == "tool_choice"


def test_a_reasoning_effort_reaches_the_template_and_turns_qwen3s_thinking_off():
    from surge.errors import InvalidInput
    from surge.server.http.reasoning import effort_variables, request_parser

    assert effort_variables("deepseek_r1", None, {"x": 1}, "p") == {"x": 1}
    assert effort_variables("deepseek_r1", "high", None, "p") == {"reasoning_effort": "high"}
    off = effort_variables("qwen3", "none", None, "p")
    assert off == {"reasoning_effort": "none", "enable_thinking": False} and request_parser("qwen3", off) == "none"
    on = effort_variables("qwen3", "low", None, "p")
    assert "enable_thinking" not in on and request_parser("qwen3", on) == "qwen3"
    # what the request set itself wins
    assert effort_variables("qwen3", "minimal", {"enable_thinking": True}, "p")["enable_thinking"] is True
    for parser, effort in (("none", "high"), ("qwen3", "extreme")):
        with pytest.raises(InvalidInput) as info:
            effort_variables(parser, effort, None, "reasoning_effort")
        assert info.value.param == "reasoning_effort"
