"""Tool calls end to end: a tiny Qwen2-shaped model trained here to answer a weather question with a
Hermes tool call, served by a real `surge serve --generation tool_call_parser=hermes`, called with the
real openai client (whole and streamed). The model's text is transformers' greedy text; the calls are
what that text says."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.trained_models import ANSWER, ASK, TOOL, train_tool_model  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return train_tool_model(tmp_path_factory.mktemp("toolmodel") / "tool-qwen")


@pytest.fixture(scope="module")
def client(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "tool_call_parser=hermes") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_a_tool_call_whole_and_streamed(client):
    r = client.chat.completions.create(model="tool-qwen", messages=ASK, tools=[TOOL], temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model="tool-qwen", messages=ASK, tools=[TOOL], temperature=0,
                                                 max_tokens=60, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == "Checking." and finishes == ["tool_calls"]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_weather", {"city": "Paris"})]


def test_tool_choice_none_leaves_the_text_and_auto_without_tools_is_plain(client):
    r = client.chat.completions.create(model="tool-qwen", messages=ASK, tools=[TOOL], tool_choice="none",
                                       temperature=0, max_tokens=60)
    assert r.choices[0].message.content == ANSWER and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"



def test_tool_choice_required_holds_the_answer_to_calls(client, model_dir):
    """The trained answer starts with text; a required tool choice leaves none (guided decoding): the call
    is transformers' greedy answer held to the same grammar, whose `<tool_call>` tags are the added tokens
    the model writes (a grammar that spelled them as text would match nothing this model writes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from surge.runtime.guided import Guides
    from surge.server.http.guided_fields import tool_choice_guide
    from surge.server.http.tool_calls import parse
    from tests.guided_reference import hf_guided

    r = client.chat.completions.create(model="tool-qwen", messages=ASK, tools=[TOOL], tool_choice="required",
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    hf, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    literal = Guides((model_dir / "tokenizer.json").read_text(), hf.config.vocab_size).literal
    assert literal("<tool_call>").startswith("<[")  # an added token llguidance counts as special
    ids = tok.apply_chat_template(ASK, tools=[TOOL], add_generation_prompt=True, tokenize=True, return_dict=False)
    want = tok.decode(hf_guided(hf, model_dir, ids, tool_choice_guide([TOOL], "required", literal), 60),
                      skip_special_tokens=True)
    content, calls = parse(want)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(call.function.name, call.function.arguments)]
