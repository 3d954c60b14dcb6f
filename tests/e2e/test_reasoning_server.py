"""Reasoning parsers end to end: a tiny Qwen2-shaped model trained here to think before it answers
(`<think>...</think>answer`, as DeepSeek-R1's distills do), served by a real
`surge serve --generation reasoning_parser=deepseek_r1`, called with the real openai client (whole and
streamed). The thinking and the answer are transformers' greedy text split by vLLM's rule; served
without the parser, all of it stays content; a structured output holds only the answer, after the
thinking, as transformers' greedy decoding under the same grammar does."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.server_process import ServerProcess  # noqa: E402
from tests.trained_models import THINK_ANSWER as ANSWER  # noqa: E402
from tests.trained_models import THINK_ASK as ASK  # noqa: E402
from tests.trained_models import THINKING, train_thinking_model  # noqa: E402


def _prompt_ids(hf) -> list[int]:
    prompt = hf.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    return hf(prompt, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return train_thinking_model(tmp_path_factory.mktemp("reasonmodel") / "think-qwen")


@pytest.fixture(scope="module")
def hf_text(model_dir):
    """transformers' greedy text of the answer to ASK (what the served model must write)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    p_ids = _prompt_ids(tok)
    got = hf.generate(torch.tensor([p_ids]), max_new_tokens=60, do_sample=False)[0, len(p_ids):]
    return tok.decode(got, skip_special_tokens=True)


@pytest.fixture(scope="module")
def client(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "reasoning_parser=deepseek_r1") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _streamed(client, **kw) -> tuple[str, str, list]:
    kw = {"max_tokens": 60, **kw}
    chunks = list(client.chat.completions.create(model="think-qwen", messages=ASK, temperature=0, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning, content, [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_the_thinking_is_separated_whole_and_streamed(client, hf_text):
    from surge.server.http.reasoning import split

    assert hf_text == ANSWER
    reasoning, content = split(hf_text, "deepseek_r1")
    assert (reasoning, content) == (THINKING, "\n\nParis.")
    r = client.chat.completions.create(model="think-qwen", messages=ASK, temperature=0, max_tokens=60)
    msg = r.choices[0].message
    assert msg.content == content and msg.reasoning == reasoning and r.choices[0].finish_reason == "stop"
    assert "reasoning_content" not in msg.model_dump()  # vLLM's field today is `reasoning` only

    got_reasoning, got_content, finishes = _streamed(client)
    assert (got_reasoning, got_content, finishes) == (reasoning, content, ["stop"])


def test_cut_off_while_thinking_is_all_reasoning_and_include_reasoning_false_drops_it(client, hf_text):
    r = client.chat.completions.create(model="think-qwen", messages=ASK, temperature=0, max_tokens=5)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None
    assert msg.reasoning and hf_text.startswith("<think>" + msg.reasoning)
    assert _streamed(client, max_tokens=5) == (msg.reasoning, "", ["length"])

    r = client.chat.completions.create(model="think-qwen", messages=ASK, temperature=0, max_tokens=60,
                                       extra_body={"include_reasoning": False})
    assert r.choices[0].message.content == "\n\nParis." and getattr(r.choices[0].message, "reasoning", None) is None
    assert _streamed(client, extra_body={"include_reasoning": False}) == ("", "\n\nParis.", ["stop"])


def test_a_structured_output_starts_after_the_thinking(client, model_dir):
    """A choice constraint with the parser: the model thinks freely, then answers one of the choices; the
    served text is transformers' greedy text under the same grammar (the thinking, then the constraint)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from surge.runtime.guided import after_reasoning
    from surge.server.http.reasoning import split
    from tests.guided_reference import hf_guided

    choices = ["Rome", "Paris"]
    r = client.chat.completions.create(model="think-qwen", messages=ASK, temperature=0, max_tokens=60,
                                       extra_body={"structured_outputs": {"choice": choices}})
    msg = r.choices[0].message
    hf, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    guide = after_reasoning(("choice", json.dumps(choices)), tok.convert_tokens_to_ids("</think>"))
    want = tok.decode(hf_guided(hf, model_dir, _prompt_ids(tok), guide, 60), skip_special_tokens=True)
    assert (msg.reasoning, msg.content) == split(want, "deepseek_r1")
    assert msg.reasoning == THINKING and msg.content in choices
    got = _streamed(client, extra_body={"structured_outputs": {"choice": choices}})
    assert got[:2] == (msg.reasoning, msg.content)


def test_info_reports_the_parser_and_a_model_without_it_keeps_the_thinking_in_content(client, model_dir, hf_text):
    import httpx

    info = httpx.get(str(client.base_url).removesuffix("/v1/") + "/info").json()
    assert info["model_type"]["generate"]["reasoning_parser"] == "deepseek_r1"
    with ServerProcess(str(model_dir), "--threads", "1") as srv:
        plain = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = plain.chat.completions.create(model="think-qwen", messages=ASK, temperature=0, max_tokens=60)
        assert r.choices[0].message.content == hf_text and getattr(r.choices[0].message, "reasoning", None) is None
        assert _streamed(plain) == ("", hf_text, ["stop"])
        assert httpx.get(srv.url + "/info").json()["model_type"]["generate"]["reasoning_parser"] == "none"
