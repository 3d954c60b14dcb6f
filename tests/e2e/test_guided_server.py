"""Structured outputs end to end: a real `surge serve` process with a decoder whose tokenizer can write any
byte, called with the real `openai` client; every guided answer equals transformers' `generate` held to the
same constraint by llguidance (tests/guided_reference.py), and the answers that finish parse."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from surge.runtime.guided import guide_for  # noqa: E402
from surge.server.http.guided_fields import tool_choice_guide  # noqa: E402
from tests.decoder_models import build_model, load_hf  # noqa: E402
from tests.guided_reference import hf_guided  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "rain": {"type": "boolean"},
                                           "temp": {"type": "integer", "minimum": -30, "maximum": 45}},
          "required": ["city", "rain", "temp"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
             "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"], "additionalProperties": False}}}]
CHAT = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("guided") / "guided-qwen", seed=3, vocab=512, all_bytes=True,
                       max_position_embeddings=1024)  # the tools rendered into a prompt: ~420 tokens


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "tool_call_parser=hermes") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def reference(hf, model_dir, guide, n, messages=None, prompt=None, tools=None) -> str:
    model, tok = hf
    ids = (tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
           if messages is not None else tok(prompt)["input_ids"])
    return tok.decode(hf_guided(model, model_dir, ids, guide, n), skip_special_tokens=True)


def test_json_schema_answers_follow_the_schema_streamed_or_not(client, hf, model_dir):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="guided-qwen", messages=CHAT, response_format=fmt, temperature=0,
                                       max_tokens=60)
    text = r.choices[0].message.content
    assert text == reference(hf, model_dir, guide_for("json", SCHEMA, "x"), 60, messages=CHAT)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    stream = client.chat.completions.create(model="guided-qwen", messages=CHAT, response_format=fmt,
                                            temperature=0, max_tokens=60, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    # json_object: any JSON object (what a model this small writes may be cut at max_tokens)
    r = client.chat.completions.create(model="guided-qwen", messages=CHAT, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=40)
    assert r.choices[0].message.content == reference(hf, model_dir, ("json", '{"type": "object"}'), 40,
                                                     messages=CHAT)
    assert r.choices[0].message.content.startswith("{")


def test_vllm_guided_fields_on_completions(client, hf, model_dir):
    prompt = "The answer is"
    r = client.completions.create(model="guided-qwen", prompt=prompt, temperature=0, max_tokens=30,
                                  extra_body={"guided_choice": ["yes", "no", "not sure"]})
    assert r.choices[0].text == reference(hf, model_dir, guide_for("choice", ["yes", "no", "not sure"], "x"), 30,
                                          prompt=prompt)
    assert r.choices[0].text in ("yes", "no", "not sure") and r.choices[0].finish_reason == "stop"
    regex = r"[A-Z]{2}-[0-9]{3,4}"
    r = client.completions.create(model="guided-qwen", prompt=prompt, temperature=0, max_tokens=30,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert r.choices[0].text == reference(hf, model_dir, ("regex", regex), 30, prompt=prompt)
    assert re.fullmatch(regex, r.choices[0].text)
    # seeded draws with n: every choice held to the grammar
    r = client.completions.create(model="guided-qwen", prompt=prompt, temperature=1.0, seed=7, n=4, max_tokens=30,
                                  extra_body={"guided_grammar": 'start: "(" /[a-c]{1,3}/ ("," /[a-c]{1,3}/){0,2} ")"'})
    assert len(r.choices) == 4
    for c in r.choices:
        assert re.fullmatch(r"\([a-c]{1,3}(,[a-c]{1,3}){0,2}\)", c.text), c.text


def test_required_and_named_tool_choice_answer_with_calls(client, hf, model_dir):
    r = client.chat.completions.create(model="guided-qwen", messages=CHAT, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=80)
    msg = r.choices[0].message
    want = reference(hf, model_dir, tool_choice_guide(TOOLS, "required"), 80, messages=CHAT, tools=TOOLS)
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", want)
    # cut by max_tokens (the model calls on): "length", as vLLM's required tool choice says
    ended = r.usage.completion_tokens < 80
    assert r.choices[0].finish_reason == ("tool_calls" if ended else "length")
    assert msg.tool_calls and len(msg.tool_calls) == len(calls) and not (msg.content or "").strip()
    for call, body in zip(msg.tool_calls, calls):
        obj = json.loads(body)
        assert call.function.name == obj["name"] in ("get_weather", "add")
        assert json.loads(call.function.arguments) == obj["arguments"]
    r = client.chat.completions.create(model="guided-qwen", messages=CHAT, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model="guided-qwen", messages=CHAT, tools=TOOLS, tool_choice=named,
                                       temperature=0, max_tokens=80)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"} and all(0 <= v <= 9 for v in args.values())
    stream = client.chat.completions.create(model="guided-qwen", messages=CHAT, tools=TOOLS, tool_choice=named,
                                            temperature=0, max_tokens=80, stream=True)
    streamed = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [("add", args)]


def test_bad_constraints_are_400_naming_their_field(client):
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
              "response_format"),
             ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
             ({"extra_body": {"guided_choice": ["a"], "guided_regex": "b"}}, "guided_choice"),  # the second found
             ({"response_format": {"type": "xml"}}, "response_format"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="guided-qwen", messages=CHAT, max_tokens=5, **kw)
        assert err.value.body["param"] == param, (kw, err.value.body)


def test_kserve_generate_and_tritonclient_infer_take_the_same_fields(server, hf, model_dir):
    import httpx
    import numpy as np
    import tritonclient.http as thttp

    prompt = "The answer is"
    choices = ["yes", "no", "not sure"]
    want = reference(hf, model_dir, guide_for("choice", choices, "x"), 30, prompt=prompt)
    r = httpx.post(server.url + "/v2/models/guided-qwen/generate", timeout=60, json={
        "text_input": prompt, "parameters": {"temperature": 0, "max_tokens": 30, "guided_choice": choices}})
    assert r.status_code == 200 and r.json()["text_output"] == want, r.text
    r = httpx.post(server.url + "/v2/models/guided-qwen/generate", timeout=60,
                   json={"text_input": prompt, "guided_regex": "a(b"})
    assert r.status_code == 400 and "guided_regex" in r.text
    regex = r"[A-Z]{2}-[0-9]{3,4}"
    client = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    text = thttp.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    sampling = thttp.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps({"temperature": 0, "max_tokens": 30,
                                                       "structured_outputs": {"regex": regex}}).encode()],
                                          dtype=object))
    flag = thttp.InferInput("exclude_input_in_output", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    try:
        out = client.infer("guided-qwen", [text, sampling, flag]).as_numpy("text_output")[0].decode()
    finally:
        client.close()
    assert out == reference(hf, model_dir, ("regex", regex), 30, prompt=prompt) and re.fullmatch(regex, out)


@pytest.fixture(scope="module")
def second_call_cut(hf, model_dir) -> tuple[dict, int, int]:
    """(the first call of transformers' answer to CHAT held to tool_choice required, a max_tokens that ends
    inside its second call, the prompt's length)."""
    model, tok = hf
    ids = tok.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = hf_guided(model, model_dir, ids, tool_choice_guide(TOOLS, "required"), 200)
    ends = [i + 1 for i in range(len(full)) if tok.decode(full[: i + 1]).count("</tool_call>") == 1
            and tok.decode(full[:i]).count("</tool_call>") == 0]
    assert ends and "<tool_call>" in tok.decode(full[ends[0]:]), "the reference writes a second call"
    first = json.loads(re.findall(r"<tool_call>\n(.*?)\n</tool_call>", tok.decode(full))[0])
    cut = ends[0] + 6  # inside the second call: `\n<tool_call>\n{"name` and a little more
    assert "</tool_call>" not in tok.decode(full[ends[0]:cut])
    return first, cut, len(ids)


def test_a_required_call_cut_by_max_tokens_keeps_its_complete_calls_and_no_partial_json(client, second_call_cut):
    """tool_choice required, max_tokens ending inside the second call: the first (complete) call is a tool call,
    the cut one is not content (vLLM's required tool choice: finish_reason "tool_calls" only when the answer
    ended, else "length"), streamed or not."""
    first, cut, _ = second_call_cut
    r = client.chat.completions.create(model="guided-qwen", messages=CHAT, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=cut)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == cut
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] \
        == [(first["name"], first["arguments"])]
    assert not choice.message.content, choice.message.content
    stream = client.chat.completions.create(model="guided-qwen", messages=CHAT, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=cut, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    assert [(t.function.name, json.loads(t.function.arguments)) for c in chunks for t in (c.delta.tool_calls or [])] \
        == [(first["name"], first["arguments"])]
    assert chunks[-1].finish_reason == "length"


# the same tools in Anthropic's and the Responses API's shapes (rendered into the same prompt as TOOLS)
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
                    **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
                   for t in TOOLS]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_a_forced_tool_use_cut_by_max_tokens_says_max_tokens_and_keeps_its_complete_calls(server, second_call_cut):
    """Anthropic's Messages API, tool_choice any cut inside the second call: the complete call is a tool_use
    block, the cut one's partial JSON is no text block, and stop_reason is "max_tokens" (Anthropic's: the
    limit was hit), streamed or not; tool_choice naming a tool cut inside its one call: no text, max_tokens."""
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    first, cut, prompt = second_call_cut
    ask = {"model": "guided-qwen", "messages": CHAT, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"},
           "max_tokens": cut, "extra_body": {"temperature": 0}}
    m = c.messages.create(**ask)
    with c.messages.stream(**ask) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == ""
    for msg in (m, final):
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt  # the reference's prompt
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == cut
        assert [(b.type, b.name, b.input) for b in msg.content] == [("tool_use", first["name"], first["arguments"])]
    named = c.messages.create(**{**ask, "tool_choice": {"type": "tool", "name": "add"}, "max_tokens": 6})
    assert named.stop_reason == "max_tokens" and named.usage.output_tokens == 6
    assert all(b.type == "text" and b.text == "" for b in named.content), named.content


def test_a_forced_function_call_cut_by_max_output_tokens_is_incomplete_with_its_complete_calls(client,
                                                                                              second_call_cut):
    """The Responses API, tool_choice required cut inside the second call: the complete call is a
    function_call item, the cut one's partial JSON is no output_text, and the response is incomplete
    (max_output_tokens), streamed or not; tool_choice naming a function cut inside its one call: no text."""
    first, cut, prompt = second_call_cut
    ask = {"model": "guided-qwen", "input": CHAT[0]["content"], "tools": FLAT_TOOLS, "tool_choice": "required",
           "temperature": 0, "max_output_tokens": cut}
    r = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ""
    assert events[-1].type == "response.incomplete"
    for resp in (r, events[-1].response):
        assert resp.usage.input_tokens == prompt  # the reference's prompt
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        assert resp.usage.output_tokens == cut and resp.output_text == ""
        assert [(o.type, o.name, json.loads(o.arguments)) for o in resp.output] == \
            [("function_call", first["name"], first["arguments"])]
    named = client.responses.create(**{**ask, "tool_choice": {"type": "function", "name": "add"},
                                       "max_output_tokens": 6})
    assert named.status == "incomplete" and named.usage.output_tokens == 6
    assert named.output_text == "" and not [o for o in named.output if o.type == "function_call"]


def test_json_on_a_vocabulary_without_braces_is_a_400_not_a_stray_quote(tmp_path):
    """A tokenizer that cannot write `{`: a JSON response_format (or a regex that starts with one) used to
    answer `"` with finish_reason "stop"; it is a 400 naming the field, before any generation."""
    model_dir = build_model("qwen2", tmp_path / "nobrace-qwen", seed=3, vocab=384)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("{") is None
    with ServerProcess(str(model_dir), "--threads", "1") as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for kw, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
                           "response_format"),
                          ({"extra_body": {"guided_regex": r"\{[a-z]+\}"}}, "guided_regex")):
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(model="nobrace-qwen", messages=CHAT, max_tokens=8, temperature=0, **kw)
            assert err.value.body["param"] == param and "vocabulary" in err.value.body["message"], err.value.body
        # a constraint this vocabulary can write still answers
        r = c.chat.completions.create(model="nobrace-qwen", messages=CHAT, max_tokens=8, temperature=0,
                                      extra_body={"guided_choice": ["yes", "no"]})
        assert r.choices[0].message.content in ("yes", "no")
