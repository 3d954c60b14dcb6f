"""OpenAI's Responses API end to end: real `surge serve` processes with decoder models, called with the real
`openai` client's `responses` resource (create, stream, parse, retrieve, delete, cancel, input items; sync
and async). Answers are transformers' greedy answers to the same conversation rendered by the same chat
template (Qwen2.5's way with tools); guided answers are transformers' held by llguidance
(tests/guided_reference.py); tool calls are what the model's text says."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from surge.runtime.guided import Guides, guide_for  # noqa: E402
from surge.server.http.guided_fields import tool_choice_guide  # noqa: E402
from surge.server.http.tool_calls import parse as parse_calls  # noqa: E402
from tests.decoder_models import QWEN_TOOLS, build_model, load_hf  # noqa: E402
from tests.guided_reference import hf_guided  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.trained_models import ASK, TOOL, train_tool_model  # noqa: E402

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Define assignment."}
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "rain": {"type": "boolean"}},
          "required": ["city", "rain"], "additionalProperties": False}
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": {
                  "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                  "additionalProperties": False}},
              {"type": "function", "name": "add", "parameters": {
                  "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["a"], "additionalProperties": False}}]


def chat_tool(flat: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in flat.items() if k != "type"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("responses") / "resp-qwen", seed=11, vocab=512,
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
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def prompt_ids(hf, messages, tools=None) -> list[int]:
    return list(hf[1].apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                          return_dict=False))


def greedy(hf, messages, n, tools=None) -> tuple[str, list[int], list[int]]:
    """(text, output tokens with the EOS if written, prompt tokens) of transformers' greedy answer."""
    model, tok = hf
    ids = prompt_ids(hf, messages, tools)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):]
    return tok.decode(out, skip_special_tokens=True), out.tolist(), ids


def check_outcome(r, out: list[int], n: int, eos: int) -> None:
    stopped = bool(out) and out[-1] == eos
    assert r.usage.output_tokens == len(out)
    if stopped or len(out) < n:
        assert r.status == "completed" and r.incomplete_details is None
    else:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_a_response_equals_transformers_whole_streamed_and_async(client, server, hf):
    eos = hf[0].config.eos_token_id
    text, out, ids = greedy(hf, [SYSTEM, USER], 24)
    r = client.responses.create(model="resp-qwen", instructions=SYSTEM["content"], input=USER["content"],
                                max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "resp-qwen"
    assert r.output_text == text and r.usage.input_tokens == len(ids)
    assert r.usage.total_tokens == len(ids) + len(out)
    check_outcome(r, out, 24, eos)
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"

    # the raw events (the SDK's stream helper returns a final response only after response.completed, and
    # an answer cut at max_output_tokens ends with response.incomplete, as OpenAI's do: openai-python #3538)
    events = list(client.responses.create(model="resp-qwen", instructions=SYSTEM["content"], input=USER["content"],
                                          max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == len(out) and final.status == r.status
    # the same greedy request again: answered from the generation cache, no prompt token computed
    assert final.usage.input_tokens_details.cached_tokens == len(ids)
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1

    asks = ["Define assignment.", "What is a loop?", "Name a list."]
    refs = [greedy(hf, [{"role": "user", "content": a}], 16)[0] for a in asks]

    async def together():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(aclient.responses.create(model="resp-qwen", input=a, max_output_tokens=16,
                                                                   temperature=0) for a in asks))

    assert [x.output_text for x in asyncio.run(together())] == refs


def test_previous_response_id_continues_and_the_store_reads_back(client, hf):
    first = client.responses.create(model="resp-qwen", input=USER["content"], max_output_tokens=12, temperature=0)
    follow = {"role": "user", "content": "And a variable?"}
    second = client.responses.create(model="resp-qwen", input=[follow], previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    # the first answer is the assistant's turn; instructions are not carried over (there were none)
    text, out, ids = greedy(hf, [USER, {"role": "assistant", "content": first.output_text}, follow], 12)
    assert second.output_text == text and second.usage.input_tokens == len(ids)
    assert second.previous_response_id == first.id

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.status == first.status
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "And a variable?")]

    third = client.responses.create(model="resp-qwen", input="Once more.", previous_response_id=second.id,
                                    max_output_tokens=8, temperature=0)
    chain = [USER, {"role": "assistant", "content": first.output_text}, follow,
             {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Once more."}]
    assert third.output_text == greedy(hf, chain, 8)[0]

    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="resp-qwen", input="x", previous_response_id=first.id, max_output_tokens=2)
    unstored = client.responses.create(model="resp-qwen", input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_instructions_and_developer_messages_are_one_system_message(client, hf):
    """Codex CLI's shape: instructions and a developer message in the input; rendered as one leading system
    message (the template knows no developer role), as transformers renders that chat."""
    dev = {"role": "developer", "content": "Answer in one line."}
    r = client.responses.create(model="resp-qwen", instructions="You are terse.", input=[dev, USER],
                                max_output_tokens=12, temperature=0)
    want = [{"role": "system", "content": "You are terse.\n\nAnswer in one line."}, USER]
    text, _, ids = greedy(hf, want, 12)
    assert r.usage.input_tokens == len(ids) and r.output_text == text


def test_truncation_auto_drops_the_oldest_turns(client, hf):
    """A conversation longer than the context: refused as it is, answered with its oldest turns left out
    under truncation 'auto' (equal to transformers' answer to what is left)."""
    long = {"role": "user", "content": "Define assignment and loops and lists. " * 60}
    turns = [long, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And a variable?"}]
    assert len(prompt_ids(hf, turns)) > 1024 - 16
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="resp-qwen", input=turns, max_output_tokens=16, temperature=0)
    r = client.responses.create(model="resp-qwen", input=turns, max_output_tokens=16, temperature=0,
                                truncation="auto")
    assert r.output_text == greedy(hf, turns[2:], 16)[0] and r.truncation == "auto"


def test_logprobs_are_transformers_log_softmax(client, hf):
    model, tok = hf
    r = client.responses.create(model="resp-qwen", input=USER["content"], max_output_tokens=6, temperature=0,
                                top_logprobs=3, include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    _, out, ids = greedy(hf, [USER], 6)
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].double().log_softmax(-1)
    assert len(lps) == len(out)
    for k, item in enumerate(lps):
        assert abs(item.logprob - logits[k, out[k]].item()) < 1e-3
        assert len(item.top_logprobs) == 3
        top = logits[k].topk(3).values.tolist()
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top, abs=1e-3)
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)  # greedy: the best


def test_text_format_json_schema_and_parse(client, hf, model_dir):
    import jsonschema
    import pydantic

    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model="resp-qwen", input=ASK[0]["content"], text={"format": fmt}, temperature=0,
                                max_output_tokens=60)
    model, tok = hf
    want = tok.decode(hf_guided(model, model_dir, prompt_ids(hf, ASK), guide_for("json", SCHEMA, "x"), 60),
                      skip_special_tokens=True)
    assert r.output_text == want and r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"

    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        rain: bool

    parsed = client.responses.parse(model="resp-qwen", input=ASK[0]["content"], text_format=Weather,
                                    temperature=0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Weather)


def test_required_tool_choice_gives_function_calls_whole_and_streamed(client, hf, model_dir):
    model, tok = hf
    tools = [chat_tool(t) for t in FLAT_TOOLS]
    r = client.responses.create(model="resp-qwen", input=ASK[0]["content"], tools=FLAT_TOOLS, tool_choice="required",
                                temperature=0, max_output_tokens=80)
    literal = Guides((model_dir / "tokenizer.json").read_text(), model.config.vocab_size).literal
    guide = tool_choice_guide(tools, "required", literal)
    want = tok.decode(hf_guided(model, model_dir, prompt_ids(hf, ASK, tools), guide, 80), skip_special_tokens=True)
    _, calls = parse_calls(want)
    assert calls and all(item.type == "function_call" for item in r.output)
    assert [(c.name, json.loads(c.arguments)) for c in r.output] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in r.output)

    with client.responses.stream(model="resp-qwen", input=ASK[0]["content"], tools=FLAT_TOOLS,
                                 tool_choice="required", temperature=0, max_output_tokens=80) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [(c.name, json.loads(c.arguments)) for c in r.output]
    assert [(c.type, c.name, c.arguments) for c in final.output] == [(c.type, c.name, c.arguments) for c in r.output]

    one = client.responses.create(model="resp-qwen", input=ASK[0]["content"], tools=FLAT_TOOLS,
                                  tool_choice={"type": "function", "name": "add"}, temperature=0,
                                  max_output_tokens=80)
    assert [c.name for c in one.output] == ["add"]


def test_background_runs_reads_back_and_cancels(client, hf):
    eos = hf[0].config.eos_token_id
    text, out, _ = greedy(hf, [USER], 24)
    r = client.responses.create(model="resp-qwen", input=USER["content"], max_output_tokens=24, temperature=0,
                                background=True)
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)  # a client of a background response polls (the API has no other way)
        r = client.responses.retrieve(r.id)
    assert r.output_text == text
    check_outcome(r, out, 24, eos)

    long = client.responses.create(model="resp-qwen", input=USER["content"], max_output_tokens=900, temperature=0,
                                   background=True, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model="resp-qwen", input="x", max_output_tokens=2).id)
    for bad in ({"stream": True}, {"store": False}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="resp-qwen", input="x", background=True, **bad)


def test_what_surge_cannot_do_is_refused(client):
    cases = [
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ]
    for extra, param in cases:
        body = {"model": "resp-qwen", "input": "x", "max_output_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**body)
        assert info.value.body["param"] == param, (extra, info.value.body)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return train_tool_model(tmp_path_factory.mktemp("resptool") / "tool-qwen")


def test_a_tool_call_and_its_output_continue_the_conversation(tool_model):
    """The trained model's answer is text then a call: a message item, then a function_call item; the
    client's function_call_output continues it (previous_response_id), rendered as transformers renders
    the same turns (the call's arguments an object, as the template wants them)."""
    hf = load_hf(tool_model)
    flat = {"type": "function", **TOOL["function"]}
    with ServerProcess(str(tool_model), "--threads", "1", "--generation", "tool_call_parser=hermes") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.responses.create(model="tool-qwen", input=ASK[0]["content"], tools=[flat], temperature=0,
                                    max_output_tokens=60)
        msg, call = r.output
        assert msg.type == "message" and msg.content[0].text == "Checking."
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}

        with client.responses.stream(model="tool-qwen", input=ASK[0]["content"], tools=[flat], temperature=0,
                                     max_output_tokens=60) as stream:
            final = stream.get_final_response()
        assert [(o.type, getattr(o, "name", None)) for o in final.output] == [("message", None),
                                                                              ("function_call", "get_weather")]
        assert final.output[0].content[0].text == "Checking." and final.output[1].arguments == call.arguments

        answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
        r2 = client.responses.create(model="tool-qwen", input=[answer], previous_response_id=r.id, tools=[flat],
                                     temperature=0, max_output_tokens=20)
    turns = [*ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "Sunny, 21 C"}]
    text, out, ids = greedy(hf, turns, 20, tools=[TOOL])
    assert r2.usage.input_tokens == len(ids)
    content, calls = parse_calls(text)
    got_text = "".join(o.content[0].text for o in r2.output if o.type == "message")
    assert got_text == (content or "")
    assert [(o.name, o.arguments) for o in r2.output if o.type == "function_call"] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_a_reasoning_models_thinking_is_a_reasoning_item(tmp_path_factory):
    """With the model's reasoning parser the thinking is a `reasoning` item (reasoning_text), the answer a
    message after it, whole and streamed; the thinking's tokens are counted as reasoning tokens, and a
    continued conversation renders the answer without the thinking (as chat templates drop it)."""
    from surge.server.http.reasoning import split
    from tests.trained_models import THINK_ANSWER, THINK_ASK, THINKING, train_thinking_model

    model_dir = train_thinking_model(tmp_path_factory.mktemp("respthink") / "think-qwen")
    hf = load_hf(model_dir)
    assert greedy(hf, THINK_ASK, 60)[0] == THINK_ANSWER
    reasoning, content = split(THINK_ANSWER, "deepseek_r1")
    assert reasoning == THINKING
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "reasoning_parser=deepseek_r1") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.responses.create(model="think-qwen", input=THINK_ASK[0]["content"], temperature=0,
                                    max_output_tokens=60)
        think, msg = r.output
        assert think.type == "reasoning" and [c.text for c in think.content] == [THINKING]
        assert msg.type == "message" and r.output_text == content and r.status == "completed"
        assert r.usage.output_tokens_details.reasoning_tokens == len(hf[1](THINKING, add_special_tokens=False)
                                                                     ["input_ids"])
        with client.responses.stream(model="think-qwen", input=THINK_ASK[0]["content"], temperature=0,
                                     max_output_tokens=60) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINKING
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
        assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == content

        # a reasoning effort reaches the template (this one does not read it: the same answer) and is echoed
        high = client.responses.create(model="think-qwen", input=THINK_ASK[0]["content"], temperature=0,
                                       max_output_tokens=60, reasoning={"effort": "high"})
        assert high.reasoning.effort == "high" and [o.type for o in high.output] == ["reasoning", "message"]
        assert high.output_text == content
        follow = {"role": "user", "content": "And of Italy?"}
        r2 = client.responses.create(model="think-qwen", input=[follow], previous_response_id=r.id, temperature=0,
                                     max_output_tokens=30)
    text, _, ids = greedy(hf, [*THINK_ASK, {"role": "assistant", "content": content}, follow], 30)
    assert r2.usage.input_tokens == len(ids)
    want_reasoning, want_content = split(text, "deepseek_r1")
    assert [c.text for o in r2.output if o.type == "reasoning" for c in o.content] == [want_reasoning]
    assert r2.output_text == (want_content or "")


def test_two_servers_sharing_a_redis_continue_each_others_responses(model_dir, hf, redis_server):
    """Servers on several hosts (Ray Serve's ingress replicas, or servers behind one balancer) keep their
    responses on one Redis: a conversation goes on from either, and a background response one server runs
    is cancelled through the other."""
    args = ("--threads", "1", "--responses-store-redis-url", redis_server)
    with ServerProcess(str(model_dir), *args) as a, ServerProcess(str(model_dir), *args) as b:
        ca, cb = (openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120) for s in (a, b))
        first = ca.responses.create(model="resp-qwen", input=USER["content"], max_output_tokens=10, temperature=0)
        follow = {"role": "user", "content": "And a variable?"}
        second = cb.responses.create(model="resp-qwen", input=[follow], previous_response_id=first.id,
                                     max_output_tokens=10, temperature=0)
        assert second.output_text == greedy(hf, [USER, {"role": "assistant", "content": first.output_text}, follow],
                                            10)[0]
        assert ca.responses.retrieve(second.id).output_text == second.output_text
        long = ca.responses.create(model="resp-qwen", input="x", max_output_tokens=900, temperature=0,
                                   background=True, extra_body={"ignore_eos": True})
        assert cb.responses.cancel(long.id).status == "cancelled"
        deadline = time.monotonic() + 60
        while (got := ca.responses.retrieve(long.id)).usage is None and not got.output and \
                time.monotonic() < deadline:
            time.sleep(0.1)  # the runner on `a` reads the cancel as its tokens arrive, then writes what it made
        assert got.status == "cancelled" and got.output and len(got.output[0].content[0].text) > 0
        cb.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            ca.responses.retrieve(first.id)
