"""vLLM's `prompt_logprobs` on /v1/completions (each choice's) and /v1/chat/completions (the response's),
against a real `surge serve` called with the real openai client: None for the prompt's first token, then
each token's {token id: {logprob, rank, decoded_token}} holding the prompt token and the top N, equal to
transformers' FP32 log_softmax of the prompt's logits. What surge cannot answer (a stream, as vLLM; more
than 20 top tokens) is a 400, never ignored."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.decoder_models import build_model, load_hf
from tests.server_process import ServerProcess

PROMPT = "Assignment statements are used to bind names to values"
CHAT = [{"role": "user", "content": "Define assignment."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("plp") / "plp-qwen", seed=4)


@pytest.fixture(scope="module")
def client(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' FP32 log-probabilities: row p scores token p + 1."""
    model, _ = hf
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]


def check(got: list, ids: list[int], lp: torch.Tensor, k: int, tok) -> None:
    """vLLM's prompt_logprobs of `ids`, each position against transformers' row."""
    assert len(got) == len(ids) and got[0] is None
    for p, entry in enumerate(got[1:]):
        token, row = ids[p + 1], lp[p]
        want_top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {str(t) for t in [token, *want_top]}, (p, entry)
        for t, item in entry.items():
            assert item["logprob"] == pytest.approx(row[int(t)].item(), abs=1e-4), (p, t)
            assert item["decoded_token"] == tok.decode([int(t)], skip_special_tokens=True)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert [entry[str(t)]["rank"] for t in want_top] == list(range(1, k + 1))


@pytest.mark.parametrize("k", [0, 3])
def test_completion_prompt_logprobs_equal_transformers(client, hf, k):
    _, tok = hf
    ids = tok(PROMPT)["input_ids"]
    r = client.completions.create(model="plp-qwen", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": k})
    check(r.choices[0].prompt_logprobs, ids, reference(hf, ids), k, tok)
    assert r.choices[0].logprobs is None  # only what was asked


def test_each_choice_carries_its_own_prompts(client, hf):
    _, tok = hf
    prompts = ["Names refer to", PROMPT]
    r = client.completions.create(model="plp-qwen", prompt=prompts, n=2, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    for c in r.choices:
        ids = tok(prompts[c.index // 2])["input_ids"]
        check(c.prompt_logprobs, ids, reference(hf, ids), 2, tok)


def test_echo_logprobs_and_prompt_logprobs_each_get_their_top(client, hf):
    """One scoring serves both: echo's top_logprobs keep `logprobs` (+ the chosen token), prompt_logprobs
    its own N."""
    _, tok = hf
    ids = tok(PROMPT)["input_ids"]
    lp = reference(hf, ids)
    r = client.completions.create(model="plp-qwen", prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                  logprobs=1, extra_body={"prompt_logprobs": 4})
    c = r.choices[0]
    check(c.prompt_logprobs, ids, lp, 4, tok)
    tops = c.logprobs.top_logprobs[1:len(ids)]
    assert all(1 <= len(t) <= 2 for t in tops)
    assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
                                                                  .tolist(), abs=1e-4)


def test_chat_prompt_logprobs_are_the_rendered_prompts(client, hf):
    _, tok = hf
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    r = client.chat.completions.create(model="plp-qwen", messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    check(r.prompt_logprobs, ids, reference(hf, ids), 2, tok)


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 2, "stream": True}, {"prompt_logprobs": 21},
                                   {"prompt_logprobs": -1}])
def test_what_cannot_be_answered_is_a_400_never_ignored(client, extra):
    stream = extra.pop("stream", False)
    calls = [lambda: client.completions.create(model="plp-qwen", prompt=PROMPT, max_tokens=2, stream=stream,
                                               extra_body=extra),
             lambda: client.chat.completions.create(model="plp-qwen", messages=CHAT, max_tokens=2, stream=stream,
                                                    extra_body=extra)]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            out = call()
            list(out) if stream else None
        assert info.value.body["param"] == "prompt_logprobs", info.value.body
