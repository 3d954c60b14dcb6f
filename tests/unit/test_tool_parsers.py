"""The tool-call parsers (server/http/tool_parsers/: hermes, llama3_json, mistral), each checked against
texts written from known calls: whole answers give the calls back (arguments JSON strings equal to the
objects written) and keep as content what is not a call; streams equal the whole answer however the text
is cut (every split point, character by character, random pieces); call ids have their parser's format; a
model's own chat template (transformers' apply_chat_template) renders calls that the parser reads back;
the grammar of a forced tool choice accepts the parser's format and only texts the parser reads as calls."""

from __future__ import annotations

import json
import random
import re

import pytest

from surge.server.http import tool_parsers
from surge.server.http.tool_calls import keep_special_tokens, parse, stream

PARSERS = ["hermes", "llama3_json", "mistral"]
ID_FORMATS = {"hermes": r"call_[0-9a-f]{24}", "llama3_json": r"call_[0-9a-f]{24}", "mistral": r"[A-Za-z0-9]{9}"}
CALLS = [
    ("get_weather", {"city": "Paris", "unit": "°C"}),
    ("search", {"q": 'a "quoted" {brace} } and ] [TOOL_CALLS] <tool_call> ; \\ \n 5" }', "n": [1, {"x": None}]}),
    ("no_args", {}),
    ("nested", {"a": {"b": {"c": [True, False, 1.5, "}"]}}}),
]


CALL_IDS = ["a1B2c3D4e", "Zz9Yy8Xx7", "000000000", "q"]  # as a v13 Mistral model names its calls (and one short)


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def write(parser: str, calls, before: str = "", form: str = "") -> str:
    """`calls` written as the parser's models write them (`form`: mistral "v11" / "args" / "call_id" for name{json}
    / name[ARGS]{json} / name[CALL_ID]id[ARGS]{json} (ids CALL_IDS); llama3_json "tag" for a leading <|python_tag|>
    and "arguments" for that key)."""
    if parser == "hermes":
        return before + "\n".join(f'<tool_call>\n{dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    if parser == "llama3_json":
        key = "arguments" if form == "arguments" else "parameters"
        body = "; ".join(dumps({"name": n, key: a}) for n, a in calls)
        return before + ("<|python_tag|>" if form == "tag" else "") + body
    if form == "call_id":
        return before + "".join(f"[TOOL_CALLS]{n}[CALL_ID]{i}[ARGS]{dumps(a)}" for (n, a), i in zip(calls, CALL_IDS))
    if form in ("v11", "args"):
        sep = "[ARGS]" if form == "args" else ""
        return before + "".join(f"[TOOL_CALLS]{n}{sep}{dumps(a)}" for n, a in calls)
    return before + "[TOOL_CALLS] " + dumps([{"name": n, "arguments": a} for n, a in calls])


def plain(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(parser: str, pieces) -> tuple[str, list[tuple[int, dict]]]:
    s = stream(parser)
    out = [x for p in pieces for x in s.feed(p)] + [(s.finish(), None)]
    return "".join(t for t, _ in out if t), [c for _, c in out if c]


def assert_stream_equals_whole(parser: str, text: str, rng: random.Random) -> None:
    content, calls = parse(text, parser)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 12))))
        cuts.append([text[a:b] for a, b in zip([0] + points, points + [len(text)])])
    for pieces in cuts:
        got_text, got = streamed(parser, pieces)
        # whole answers with only calls have no content; a stream passes their blank text on
        assert got_text == content if content is not None else not got_text.strip(), (pieces, got_text)
        assert [i for i, _ in got] == list(range(len(calls)))
        assert plain([c for _, c in got]) == plain(calls), pieces
        if "[CALL_ID]" in text:  # ids the model wrote are the same however the text came
            assert [c["id"] for _, c in got] == [c["id"] for c in calls], pieces


# (parser, text, want content, want calls): texts written from CALLS, and texts that are no calls
def cases():
    out = []
    for p in PARSERS:
        forms = {"hermes": [""], "llama3_json": ["", "tag", "arguments"], "mistral": ["", "v11", "args", "call_id"]}[p]
        for form in forms:
            for k in (1, 2, 4):
                out.append((p, write(p, CALLS[:k], form=form), None, CALLS[:k]))
        if p != "llama3_json":  # text before the calls is content (Llama's calls are the whole answer)
            # (hermes: the newline between two blocks is content too, as it was before parsers were named)
            out.append((p, write(p, CALLS[:2], before="Let me check. "),
                        "Let me check. " + ("\n" if p == "hermes" else ""), CALLS[:2]))
    out += [
        ("llama3_json", "  \n" + write("llama3_json", CALLS[:1]), None, CALLS[:1]),
        ("llama3_json", write("llama3_json", CALLS[:1]) + "\n", None, CALLS[:1]),
        ("llama3_json", write("llama3_json", CALLS[:1]) + "\nDone.", "\nDone.", CALLS[:1]),
        ("mistral", write("mistral", CALLS[:1]) + " Done.", " Done.", CALLS[:1]),
        ("mistral", "[TOOL_CALLS] " + dumps([{"name": "f", "arguments": {"x": 1}, "id": "abcDEF123"}]), None,
         [("f", {"x": 1})]),  # the id the v0.3 template writes is ignored
        ("hermes", '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [("f", {"x": 1})]),
    ]
    return out


# texts that are not calls: all content, as written
NOT_CALLS = {
    "hermes": ["no calls at all, a < sign and <tool", "<tool_call>{not json}</tool_call> after",
               '<tool_call>["a list"]</tool_call>', 'an unclosed <tool_call>{"name": "f"', ""],
    "llama3_json": ['{"name": "Bob", "age": 3}', '  {"a": 1}', '[{"name": "f", "parameters": {}}]', "{not json}",
                    '{"name": 1, "parameters": {}}', '{"name": "f", "parameters": [1]}',
                    'Here: {"name": "f", "parameters": {}}', '{"name": "f", "parameters": {"x": ',
                    "<|python_tag|>brave_search.call(query=\"x\")", "<|python_ta", "plain text", "", "   ", "{"],
    "mistral": ["no tag [TOOL_CALL", "[TOOL_CALLS]", "[TOOL_CALLS] not json", "[TOOL_CALLS] [1, 2]",
                '[TOOL_CALLS] [{"name": "f"}]', '[TOOL_CALLS] [{"name": "f", "arguments": {}', "[TOOL_CALLS]f(x)",
                '[TOOL_CALLS] {"name": "f", "arguments": {}}', "[TOOL_CALLS]name[ARGS]", "[TOOL_CALLS]f[CALL_ID]",
                "[TOOL_CALLS]f[CALL_ID]abc", "[TOOL_CALLS]f[CALL_ID]abc{}", "[TOOL_CALLS]f[CALL_ID][ARGS]{}",
                "[TOOL_CALLS]f[CALL_ID]a-b[ARGS]{}", "[TOOL_CALLS]f[CALL_ID]abc[ARGS]", "[TOOL_CALLS]f[CALL_ID]ab[AR",
                ""],
}


@pytest.mark.parametrize("parser,text,content,calls", cases())
def test_calls_written_are_read_back_whole_and_streamed(parser, text, content, calls):
    got_content, got = parse(text, parser)
    assert got_content == content
    assert plain(got) == calls
    for c, (name, args) in zip(got, calls):  # arguments: a JSON string of the object written
        assert c["type"] == "function" and isinstance(c["function"]["arguments"], str)
        assert json.loads(c["function"]["arguments"]) == args
        assert re.fullmatch(ID_FORMATS[parser], c["id"]) or "[CALL_ID]" in text
    if "[CALL_ID]" in text:  # the model's own ids, in order
        assert [c["id"] for c in got] == CALL_IDS[:len(got)]
    assert len({c["id"] for c in got}) == len(got)
    assert_stream_equals_whole(parser, text, random.Random(len(text)))


@pytest.mark.parametrize("parser,text", [(p, t) for p, ts in NOT_CALLS.items() for t in ts])
def test_what_is_not_a_call_stays_content(parser, text):
    assert parse(text, parser) == (text, [])
    assert_stream_equals_whole(parser, text, random.Random(len(text)))


def test_after_a_broken_call_the_calls_read_stay_and_the_rest_is_content():
    good = write("mistral", CALLS[:1])[:-1]  # the array left open
    text = good + ', {"name": 3}] and [TOOL_CALLS]g{"y": 2}'
    content, calls = parse(text, "mistral")
    assert plain(calls) == [CALLS[0], ("g", {"y": 2})] and content == ', {"name": 3}] and '
    text = write("llama3_json", CALLS[:1]) + '; {"a": 1}'
    assert (parse(text, "llama3_json")[0], plain(parse(text, "llama3_json")[1])) == ('; {"a": 1}', CALLS[:1])
    for p, t in (("mistral", text), ("llama3_json", text), ("mistral", good + ', {"name": 3}]')):
        assert_stream_equals_whole(p, t, random.Random(1))


def test_random_texts_stream_as_they_parse():
    """Random mixes of calls, tags, separators, brackets and text: whatever a text is, its stream in any
    pieces equals its whole parse."""
    rng = random.Random(7)
    bits = ["[TOOL_CALLS]", "<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", "[", "]", ",", "; ", '"',
            "\\", " ", "\n", "f", "[ARGS]", dumps({"name": "f", "arguments": {}}),
            dumps({"name": "g", "parameters": {"x": "}"}}), "text"]
    for _ in range(150):
        text = "".join(rng.choice(bits) for _ in range(rng.randint(0, 12)))
        for p in PARSERS:
            content, calls = parse(text, p)
            assert_stream_equals_whole(p, text, rng)
            if not calls:
                assert content == text


def test_streams_let_content_out_early_and_calls_out_when_complete():
    s = stream("llama3_json")
    assert s.feed("Sunny") == [("Sunny", None)]  # not a call: content at once
    s = stream("llama3_json")
    assert s.feed(" <|python_") == [] and s.feed("tag|>{") == []
    first = dumps({"name": "f", "parameters": {"x": 1}})
    got = s.feed(first[1:] + ";")  # the object closed: the call goes out before what follows is known
    assert [(c["function"]["name"]) for _, (_, c) in got] == ["f"]
    s = stream("mistral")
    assert s.feed("Hi [TOOL") == [("Hi ", None)]
    got = s.feed("_CALLS] [" + dumps({"name": "f", "arguments": {}}) + ", {")  # the first element of the array
    assert [c["function"]["name"] for _, (_, c) in got] == ["f"]
    s = stream("mistral")
    assert s.feed("[TOOL_CALLS]get_wea") == [] and s.feed("ther[AR") == []
    assert [c["function"]["name"] for _, (_, c) in s.feed('GS]{"a": 1}')] == ["get_weather"]


def test_registry_config_and_special_tokens():
    from typing import get_args

    from pydantic import ValidationError

    from surge.config import GenerationConfig

    assert get_args(GenerationConfig.model_fields["tool_call_parser"].annotation) == tool_parsers.PARSERS
    assert tool_parsers.PARSERS == ("none", *PARSERS)
    for name in PARSERS:
        assert GenerationConfig(tool_call_parser=name).tool_call_parser == name
    with pytest.raises(ValidationError):
        GenerationConfig(tool_call_parser="pythonic")
    with pytest.raises(ValueError):
        parse("x", "pythonic")
    assert stream(None) is None  # calls not read; "none" is the setting's, which the routes turn into None
    with pytest.raises(ValueError):
        stream("none")
    assert [keep_special_tokens(p) for p in (None, *PARSERS)] == [False, False, False, True]


# --- rendering reference: a model's own chat template writes calls that its parser reads back ---

def _tokenizer(template: str, out):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tests.decoder_models import save_tokenizer, train_tokenizer

    save_tokenizer(train_tokenizer(), out, template)
    return AutoTokenizer.from_pretrained(out)


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n, _ in CALLS]


@pytest.mark.parametrize("parser", PARSERS)
def test_a_template_rendered_call_turn_is_read_back(parser, tmp_path):
    from tests.decoder_models import LLAMA3_TOOLS, MISTRAL_TOOLS, QWEN_TOOLS

    template = {"hermes": QWEN_TOOLS, "llama3_json": LLAMA3_TOOLS, "mistral": MISTRAL_TOOLS}[parser]
    tok = _tokenizer(template, tmp_path)
    user = [{"role": "user", "content": "Do things."}]
    prefix = tok.apply_chat_template(user, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    for k in (1, 2, 4):
        # ids as the parser makes them: the Mistral template refuses any but 9 characters
        calls = [{"id": stream(parser).new_id(), "type": "function", "function": {"name": n, "arguments": a}}
                 for n, a in CALLS[:k]]
        turn = {"role": "assistant", "content": None if parser != "hermes" else "", "tool_calls": calls}
        full = tok.apply_chat_template(user + [turn], tools=TOOLS, tokenize=False)
        assert full.startswith(prefix)
        answer = full[len(prefix):]
        answer = answer[:answer.rindex(tok.eos_token)]  # the turn's end is the model's end of sequence
        content, got = parse(answer, parser)
        assert not (content or "").strip() and plain(got) == CALLS[:k], answer
        # the parser's calls, sent back as the next turn's history, render again (the ids pass the template)
        back = [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                   "arguments": json.loads(c["function"]["arguments"])}}
                for c in got]
        again = tok.apply_chat_template(user + [{**turn, "tool_calls": back}], tools=TOOLS, tokenize=False)
        assert parse(again[len(prefix):again.rindex(tok.eos_token)], parser)[1] and plain(
            parse(again[len(prefix):again.rindex(tok.eos_token)], parser)[1]) == CALLS[:k]


# --- the grammar of a forced tool choice: the parser's own format, nothing else ---

TAGS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
GRAMMAR_TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "op": {"enum": ["plus", "minus"]}},
        "required": ["a", "op"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def guides():
    pytest.importorskip("llguidance")
    from surge.runtime.guided import Guides
    from tests.decoder_models import train_tokenizer

    tok = train_tokenizer(512, True)
    tok.add_special_tokens(TAGS)
    return Guides(tok.to_str(), tok.get_vocab_size(), [tok.token_to_id("<|im_end|>")]), tok


def _accepts(guides, guide, text: str) -> bool:
    g, tok = guides
    m = g.matcher(guide)
    for t in tok.encode(text).ids:
        if not m.consume(t):
            return False
    words = m.mask()
    return bool((int(words[g.eos[0] // 32]) >> (g.eos[0] % 32)) & 1)  # the grammar may end here


def _walk(guides, guide, rng: random.Random) -> str:
    """A random text the grammar accepts: allowed tokens drawn one by one until the end is drawn."""
    import numpy as np

    g, tok = guides
    m = g.matcher(guide)
    ids: list[int] = []
    for _ in range(400):
        words = m.mask().astype(np.uint32)
        bits = ((words[:, None] >> np.arange(32, dtype=np.uint32)) & 1).ravel()[:g.vocab_size]
        allowed = np.flatnonzero(bits)
        t = int(rng.choice(list(allowed)))
        if t == g.eos[0]:
            return tok.decode(ids, skip_special_tokens=False)
        assert m.consume(t)
        ids.append(t)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("parser", PARSERS)
def test_tool_choice_grammar_accepts_the_parsers_format(parser, guides):
    from surge.server.http.guided_fields import tool_choice_guide

    literal = guides[0].literal
    key = tool_parsers.get(parser).args_key
    one = [("add", {"a": 7, "op": "plus"})]
    two = one + [("ping", {})]

    def text(calls):  # the format as the grammar writes it: arguments under the parser's own key
        return write(parser, calls, form="arguments" if key == "arguments" and parser == "llama3_json" else "")

    required = tool_choice_guide(GRAMMAR_TOOLS, "required", literal, parser=parser)
    single = tool_choice_guide(GRAMMAR_TOOLS, "required", literal, parallel=False, parser=parser)
    named = tool_choice_guide(GRAMMAR_TOOLS, {"type": "function", "function": {"name": "ping"}}, literal,
                              parser=parser)
    guides[0].check(required, "tool_choice")
    assert _accepts(guides, required, text(one)) and _accepts(guides, required, text(two))
    assert _accepts(guides, single, text(one)) and not _accepts(guides, single, text(two))
    assert _accepts(guides, named, text([("ping", {})])) and not _accepts(guides, named, text(one))
    assert not _accepts(guides, required, "Sure. " + text(one))  # no content around the calls
    assert not _accepts(guides, required, text([("add", {"a": 7})]))  # the tool's schema holds
    others = [p for p in PARSERS if p != parser]
    for p in others:  # another parser's format is not this grammar's
        assert not _accepts(guides, required, write(p, one))
    rng = random.Random(parser)
    names = {t["function"]["name"]: t["function"]["parameters"] for t in GRAMMAR_TOOLS}
    import jsonschema

    for _ in range(25):  # what the grammar lets a model write, the parser reads as calls only
        walked = _walk(guides, required, rng)
        content, calls = parse(walked, parser)
        assert content is None and calls, walked
        for name, args in plain(calls):
            jsonschema.validate(args, names[name])
        assert plain(parse(walked, parser)[1]) == plain(calls)
        assert _accepts(guides, required, walked)
