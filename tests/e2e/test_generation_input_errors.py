"""Generation routes' bad inputs and cross-route agreement: a real `surge serve` process of a tiny decoder with a
tool-call parser, called by the openai client or httpx (each test failed before its fix, session 41). Bad inputs
get a 4xx naming the field, never a 500; vLLM's /tokenize of chat messages counts the tokens the chat route prompts
with."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.decoder_models import QWEN_TOOLS, build_model  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

NAME = "inputs-qwen"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = build_model("qwen2", tmp_path_factory.mktemp("inputs") / NAME, seed=4, template=QWEN_TOOLS)
    with ServerProcess(str(d), "--threads", "1", "--generation", "tool_call_parser=hermes") as srv:
        yield srv


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def test_tokenize_counts_the_chat_prompt_of_text_parts(server):
    """vLLM's /tokenize renders messages as chat completions does: text parts are joined, not written out as
    a Python list into the prompt."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    tok = _post(server, "/tokenize", {"model": NAME, "messages": parts})
    assert tok.status_code == 200, tok.text
    chat = _post(server, "/v1/chat/completions", {"model": NAME, "messages": parts, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert tok.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    plain = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hello world"}]}).json()
    assert tok.json()["tokens"] == plain["tokens"]


@pytest.mark.parametrize("content", [5, True, 1.5])
def test_anthropic_tool_result_of_odd_content_is_a_400(server, content):
    msg = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]}
    for path, body in (("/v1/messages", {"max_tokens": 2}), ("/v1/messages/count_tokens", {})):
        r = _post(server, path, {"model": NAME, "messages": [msg], **body})
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("function", ["f", ["f"], 5])
def test_chat_named_tool_choice_of_the_wrong_shape_is_a_400(server, function):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       tools=TOOLS, tool_choice={"type": "function", "function": function})
    assert err.value.body["param"] == "tool_choice"
    # and the server goes on answering
    ok = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [[1, 2], [[1, 2]], ["hi"]])
def test_responses_bad_input_is_told_what_responses_take(server, bad):
    """The embeddings' hint (strings, token ids) is wrong for the Responses API's input (a string or items)."""
    r = _post(server, "/v1/responses", {"model": NAME, "input": bad, "max_output_tokens": 2})
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert "token ids" not in message and "input items" in message, message
    assert r.json()["error"]["param"] == "input"


def test_chat_top_logprobs_without_logprobs_is_a_400(server):
    """OpenAI and vLLM refuse top_logprobs without logprobs: true; answering without them loses what was asked."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           top_logprobs=3, stream=stream)
        assert err.value.body["param"] == "top_logprobs"
    ok = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                        top_logprobs=3, logprobs=True)
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 3
    zero = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          top_logprobs=0)
    assert zero.choices[0].logprobs is None


def test_stream_options_without_stream_is_a_400(server):
    """OpenAI and vLLM refuse stream_options on a request that does not stream: the usage it asks for would
    never be sent as a chunk."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    opts = {"include_usage": True}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       stream_options=opts)
    assert err.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="x", max_tokens=2, stream_options=opts)
    assert err.value.body["param"] == "stream_options"
    chunks = list(client.completions.create(model=NAME, prompt="x", max_tokens=2, stream=True, stream_options=opts))
    assert chunks[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("tool_calls", [5, [5]])
def test_chat_template_failing_on_a_messages_odd_fields_is_a_400(server, tool_calls):
    """The template runs on the client's messages (their extra fields pass through, as vLLM passes them): a
    TypeError it raises on a field of the wrong type is the request's fault, not the server's."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": tool_calls},
            {"role": "user", "content": "y"}]
    r = _post(server, "/v1/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "chat template" in r.json()["error"]["message"]
    ok = _post(server, "/v1/chat/completions", {"model": NAME, "messages": msgs[:1], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("ids", [[1000000], [-1000], [-1]])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(server, ids):
    """Under min_tokens the sampler bans the stop token ids by indexing the logits with them: an id past the
    vocabulary raised inside the engine's step, failing every stream sharing it (a negative one banned another
    token). Checked at the edge as allowed_token_ids are."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = {"stop_token_ids": ids, "min_tokens": 1}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="x y", max_tokens=3, extra_body=extra)
    assert err.value.body["param"] == "stop_token_ids"
    ok = client.completions.create(model=NAME, prompt="x y", max_tokens=3, extra_body={"min_tokens": 1})
    assert ok.usage.completion_tokens >= 1
