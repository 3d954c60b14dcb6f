"""Speculative decoding (n-gram lookup) end to end: a real `surge serve` process started with
`--generation speculative_tokens=4` and its engine loop in a process of its own, called with the
openai client; the answers are transformers' greedy ones, streamed and not, and the acceptance
counters are on /metrics; seeded sampled answers are those of a server without speculation."""

from __future__ import annotations

import functools

import httpx
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.decoder_models import build_model, load_hf  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

_get = functools.partial(httpx.get, timeout=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("spec") / "spec-qwen", seed=6)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _seeded(url: str, messages) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    return [client.chat.completions.create(model="spec-qwen", messages=messages, max_tokens=40, temperature=0.4,
                                           seed=seed).choices[0].message.content for seed in (1, 2, 3)]


def test_speculative_answers_are_greedy_ones(model_dir):
    model, tok = load_hf(model_dir)
    conversations = [[{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}],
                     [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Define assignment."}]]
    with ServerProcess(str(model_dir), "--threads", "1", "--generation",
                       "speculative_tokens=4,cache_entries=0,engine_process=true") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        for messages in conversations:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=0)
            want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
            r = client.chat.completions.create(model="spec-qwen", messages=messages, max_tokens=40, temperature=0)
            assert r.choices[0].message.content == want
            chunks = client.chat.completions.create(model="spec-qwen", messages=messages, max_tokens=40,
                                                    temperature=0, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        metrics = _get(srv.url + "/metrics").text
        drafted = _metric(metrics, "surge_generate_spec_draft_tokens_total")
        accepted = _metric(metrics, "surge_generate_spec_accepted_tokens_total")
        assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)
        seeded = _seeded(srv.url, conversations[0])  # sampled requests are speculated too
        assert _metric(_get(srv.url + "/metrics").text, "surge_generate_spec_draft_tokens_total") > drafted
        assert len(set(seeded)) > 1  # the seeds matter
    # a seeded sampled answer is plain sampling's: the same from a server without speculation
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "cache_entries=0") as plain:
        assert _seeded(plain.url, conversations[0]) == seeded


def test_a_draft_model_through_the_server(model_dir, tmp_path):
    """`--generation speculative_tokens=3,speculative_model=DIR`: a smaller Llama of the same tokenizer drafts;
    the answers are transformers' greedy ones (plain and streamed), and its drafts are counted."""
    draft = build_model("llama", tmp_path / "draft", seed=41, hidden_size=32, intermediate_size=64,
                        num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    model, tok = load_hf(model_dir)
    messages = [{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = tok.decode(model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False,
                                     pad_token_id=0)[0, len(ids):], skip_special_tokens=True)
    with ServerProcess(str(model_dir), "--threads", "1", "--generation",
                       f"speculative_tokens=3,speculative_model={draft},cache_entries=0") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        r = client.chat.completions.create(model="spec-qwen", messages=messages, max_tokens=30, temperature=0)
        assert r.choices[0].message.content == want
        chunks = client.chat.completions.create(model="spec-qwen", messages=messages, max_tokens=30, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert _metric(_get(srv.url + "/metrics").text, "surge_generate_spec_draft_tokens_total") > 0
