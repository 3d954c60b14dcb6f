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

from tests.decoder_models import save_tokenizer, train_tokenizer  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

ASK = [{"role": "user", "content": "What is the capital of France?"}]
THINKING = "\nThe user asks for the capital of France. It is Paris.\n"
ANSWER = f"<think>{THINKING}</think>\n\nParis."


def _prompt_ids(hf) -> list[int]:
    prompt = hf.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    return hf(prompt, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Trained (seconds on the CPU) until its greedy answer to ASK is ANSWER."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("reasonmodel") / "think-qwen"
    out.mkdir()
    tok = train_tokenizer()
    tok.add_tokens(["<think>", "</think>", "\n", "?"])  # the tags as one token each, as R1's tokenizer has them
    save_tokenizer(tok, out)
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=True,
                                         bos_token_id=bos, eos_token_id=eos, pad_token_id=bos))
    hf = AutoTokenizer.from_pretrained(out)
    p_ids = _prompt_ids(hf)
    a_ids = hf(ANSWER, add_special_tokens=False)["input_ids"] + [eos]
    assert hf.decode(a_ids, skip_special_tokens=True) == ANSWER
    ids = torch.tensor([p_ids + a_ids])
    labels = ids.clone()
    labels[0, : len(p_ids)] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(400):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.eval()
    got = model.generate(torch.tensor([p_ids]), max_new_tokens=len(a_ids) + 4, do_sample=False)[0, len(p_ids):]
    assert hf.decode(got, skip_special_tokens=True) == ANSWER, "the model did not learn its answer"
    model.save_pretrained(out, safe_serialization=True)
    return out


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
