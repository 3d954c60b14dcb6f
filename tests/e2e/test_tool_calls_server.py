"""Tool calls end to end, for each tool-call parser: a tiny Qwen2-shaped model trained here to answer a
weather question with a call in the parser's format (hermes `<tool_call>` after text; llama3_json's JSON
object after the `<|python_tag|>` special token; mistral's `[TOOL_CALLS]` array after text, the tag a
special token), served by a real `surge serve --generation tool_call_parser=<parser>`, called with the real
openai client (whole and streamed). The model's text is transformers' greedy text (special tokens written
out where the parser needs them, as vLLM's mistral parser asks); the calls are what that text says."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from surge.server.http.tool_calls import keep_special_tokens, parse  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.trained_models import ASK, TOOL, TOOL_FORMATS, train_tool_model  # noqa: E402

PARSERS = list(TOOL_FORMATS)
ID_FORMATS = {"hermes": r"call_[0-9a-f]{24}", "llama3_json": r"call_[0-9a-f]{24}", "mistral": r"[A-Za-z0-9]{9}"}


@pytest.fixture(scope="module", params=PARSERS)
def served(request, tmp_path_factory):
    """(parser, model directory, openai client, transformers model, its tokenizer) of one parser's model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = request.param
    model_dir = train_tool_model(tmp_path_factory.mktemp("toolmodel") / f"tool-{parser}", parser)
    torch.set_num_threads(1)
    hf, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", f"tool_call_parser={parser}") as srv:
        yield parser, model_dir, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), hf, tok


def _prompt(tok) -> list[int]:
    return tok.apply_chat_template(ASK, tools=[TOOL], add_generation_prompt=True, tokenize=True, return_dict=False)


def _text(tok, ids: list[int], keep_special: bool) -> str:
    """The answer's text as the server writes it: the end-of-sequence token is no text."""
    while ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=not keep_special)


def _greedy(hf, tok, max_new: int = 60) -> list[int]:
    ids = _prompt(tok)
    return hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)[0, len(ids):].tolist()


def _plain(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_tool_call_whole_and_streamed(served):
    parser, _, client, hf, tok = served
    content, calls = parse(_text(tok, _greedy(hf, tok), keep_special_tokens(parser)), parser)
    assert _plain(calls) == [("get_weather", {"city": "Paris"})]  # what the model was trained to call

    r = client.chat.completions.create(model=f"tool-{parser}", messages=ASK, tools=[TOOL], temperature=0,
                                       max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and re.fullmatch(ID_FORMATS[parser], call.id)
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model=f"tool-{parser}", messages=ASK, tools=[TOOL], temperature=0,
                                                 max_tokens=60, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert streamed == (content or "") and finishes == ["tool_calls"]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in deltas] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert all(re.fullmatch(ID_FORMATS[parser], tc.id) for tc in deltas)


def test_tool_choice_none_leaves_the_text_and_auto_without_tools_is_plain(served):
    parser, _, client, hf, tok = served
    want = _text(tok, _greedy(hf, tok), keep_special=False)  # no parser: the request's skip_special_tokens
    r = client.chat.completions.create(model=f"tool-{parser}", messages=ASK, tools=[TOOL], tool_choice="none",
                                       temperature=0, max_tokens=60)
    assert r.choices[0].message.content == want and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_required_holds_the_answer_to_calls(served):
    """A required tool choice leaves no text (guided decoding) in the parser's own format: the call is
    transformers' greedy answer held to the same grammar, whose tags are the added tokens the model writes
    (a grammar that spelled them as text would match nothing this model writes)."""
    from surge.runtime.guided import Guides
    from surge.server.http.guided_fields import tool_choice_guide
    from tests.guided_reference import hf_guided

    parser, model_dir, client, hf, tok = served
    literal = Guides((model_dir / "tokenizer.json").read_text(), hf.config.vocab_size).literal
    tags = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
    if parser in tags:
        assert literal(tags[parser]).startswith("<[")  # an added token llguidance counts as special
    guide = tool_choice_guide([TOOL], "required", literal, parser=parser)
    want = _text(tok, hf_guided(hf, model_dir, _prompt(tok), guide, 60), keep_special_tokens(parser))
    content, calls = parse(want, parser)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]

    for stream in (False, True):
        r = client.chat.completions.create(model=f"tool-{parser}", messages=ASK, tools=[TOOL],
                                           tool_choice="required", temperature=0, max_tokens=60, stream=stream)
        if stream:
            chunks = list(r)
            assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
            got = [(tc.function.name, tc.function.arguments)
                   for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            assert not r.choices[0].message.content
            got = [(tc.function.name, tc.function.arguments) for tc in r.choices[0].message.tool_calls]
            finish = [r.choices[0].finish_reason]
        assert finish == ["tool_calls"]
        assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_the_responses_and_anthropic_apis_read_the_same_calls(served):
    """The item-based APIs read the answer with the same parser (and, for mistral, keep the special tokens
    it needs): a message / text block of the content, then a function_call / tool_use of the call."""
    parser, _, client, hf, tok = served
    content, calls = parse(_text(tok, _greedy(hf, tok), keep_special_tokens(parser)), parser)
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert want == [("get_weather", {"city": "Paris"})]
    flat = {"type": "function", **TOOL["function"]}
    r = client.responses.create(model=f"tool-{parser}", input=ASK[0]["content"], tools=[flat], temperature=0,
                                max_output_tokens=60)
    assert "".join(o.content[0].text for o in r.output if o.type == "message") == (content or "")
    assert [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"] == want
    with client.responses.stream(model=f"tool-{parser}", input=ASK[0]["content"], tools=[flat], temperature=0,
                                 max_output_tokens=60) as stream:
        final = stream.get_final_response()
    assert [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"] == want

    anthropic = pytest.importorskip("anthropic")
    tool = {"name": TOOL["function"]["name"], "description": TOOL["function"]["description"],
            "input_schema": TOOL["function"]["parameters"]}  # rendered as the chat tool is
    a = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x", max_retries=0)
    m = a.messages.create(model=f"tool-{parser}", messages=ASK, tools=[tool], max_tokens=60,
                          extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    assert "".join(b.text for b in m.content if b.type == "text") == (content or "")
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == want
