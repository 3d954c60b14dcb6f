"""Generation end to end: a real `surge serve` process with a decoder model, called with the real
`openai` client (sync, async, streaming) and httpx; answers checked against transformers."""

from __future__ import annotations

import asyncio
import functools
import re
import time

import httpx
import pytest

# Generous timeouts: on a busy 2-core machine a generation can take longer than httpx's default 5 s.
_get = functools.partial(httpx.get, timeout=120)
_post = functools.partial(httpx.post, timeout=120)
_stream = functools.partial(httpx.stream, timeout=120)

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.decoder_models import build_model, load_hf  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.triton_inputs import vllm_backend_inputs  # noqa: E402

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Define assignment."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # big enough that a 200-token generation takes far longer than reading two chunks
    return build_model("qwen2", tmp_path_factory.mktemp("chatmodel") / "chat-qwen", seed=4, hidden_size=128,
                       intermediate_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory):
    # ~20M parameters: a decode step takes milliseconds, so 200 tokens outlast a 0.3 s deadline many times over
    return build_model("llama", tmp_path_factory.mktemp("slowmodel") / "slow-llama", seed=5, hidden_size=512,
                       intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


def hf_text(hf, ids, n):
    model, tok = hf
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):]
    return tok.decode(out, skip_special_tokens=True), len(out)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def metric(server, name: str, **labels) -> float:
    text = _get(server.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_chat_equals_transformers_with_the_chat_template(client, hf):
    model, tok = hf
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected, n = hf_text(hf, ids, 24)
    r = client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == expected
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    assert r.choices[0].finish_reason == ("length" if n == 24 else "stop")


def test_continue_final_message_continues_the_assistants_text(client, hf):
    """vLLM's continue_final_message: the prompt ends inside the last (assistant) message, as transformers'
    apply_chat_template(continue_final_message=True) renders it, and the answer continues it."""
    prefill = [*CHAT, {"role": "assistant", "content": "Assignment is"}]
    ids = hf[1].apply_chat_template(prefill, tokenize=True, add_generation_prompt=False,
                                    continue_final_message=True, return_dict=False)
    expected, n = hf_text(hf, ids, 16)
    r = client.chat.completions.create(model="chat-qwen", messages=prefill, max_tokens=16, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "chat_template_kwargs": {"unused_variable": 1}})
    assert r.choices[0].message.content == expected and r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as err:  # both at once: transformers refuses it too
        client.chat.completions.create(model="chat-qwen", messages=prefill, max_tokens=4,
                                       extra_body={"continue_final_message": True})
    assert err.value.body["param"] == "continue_final_message"


def test_stream_concatenation_equals_the_answer_and_usage_comes_last(client):
    whole = client.chat.completions.create(messages=CHAT, model="chat-qwen", max_tokens=30, temperature=0, seed=1,
                                           frequency_penalty=0.5)
    chunks = list(client.chat.completions.create(messages=CHAT, model="chat-qwen", max_tokens=30, temperature=0,
                                                 seed=1, frequency_penalty=0.5, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_async_completions_join_a_running_batch(server, hf):
    model, tok = hf
    prompts = ["The assignment", "If a specific method is not defined, the augmented",
               "For expressions as assignment targets, the annotations are evaluated if in class", "A",
               "Assignment is defined recursively depending on the form of the target", "Names"]

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        try:
            jobs = []
            for i, p in enumerate(prompts):
                jobs.append(asyncio.create_task(client.completions.create(model="chat-qwen", prompt=p,
                                                                          max_tokens=12 + 3 * i, temperature=0)))
                await asyncio.sleep(0.01 * i)  # later ones join while earlier ones decode
            return await asyncio.gather(*jobs)
        finally:
            await client.close()

    results = asyncio.run(main())
    for i, (p, r) in enumerate(zip(prompts, results)):
        expected, _ = hf_text(hf, tok(p)["input_ids"], 12 + 3 * i)
        assert r.choices[0].text == expected, p


def test_completion_stream_ends_with_done_and_token_prompts_work(server, hf):
    model, tok = hf
    ids = tok("Assignment is defined")["input_ids"]
    body = {"model": "chat-qwen", "prompt": ids, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with _stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == hf_text(hf, ids, 10)[0]
    assert chunks[-1]["usage"]["prompt_tokens"] == len(ids)


def _by_index(chunks, field):
    out, finish = {}, {}
    for c in chunks:
        for ch in c.choices:
            out[ch.index] = out.get(ch.index, "") + (field(ch) or "")
            if ch.finish_reason:
                assert ch.index not in finish, "two finishing chunks for one choice"
                finish[ch.index] = ch.finish_reason
    return out, finish


def test_n_choices_greedy_seeded_and_streamed(client, hf):
    model, tok = hf
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected, n_tok = hf_text(hf, ids, 11)
    r = client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=11, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [expected] * 3
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3 * n_tok  # the prompt once

    # seeded: choice j samples as a single request with seed + j (longer ones here: other cache keys,
    # so each is sampled again, and must start the same way)
    kw = dict(model="chat-qwen", prompt="Assign", temperature=1.0, extra_body={"ignore_eos": True})
    many = [c.text for c in client.completions.create(**kw, max_tokens=12, seed=10, n=3).choices]
    singles = [client.completions.create(**kw, max_tokens=13, seed=10 + j).choices[0].text for j in range(3)]
    assert all(s.startswith(m) for s, m in zip(singles, many)), (many, singles)
    assert len(set(many)) == 3  # sampled choices differ
    chunks = list(client.completions.create(**kw, max_tokens=14, seed=10, n=3, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finish = _by_index(chunks, lambda ch: ch.text)
    assert sorted(texts) == [0, 1, 2] and finish == {0: "length", 1: "length", 2: "length"}
    assert all(texts[j].startswith(singles[j]) for j in range(3)), (texts, singles)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 14
    assert chunks[-1].usage.prompt_tokens == len(tok("Assign")["input_ids"])

    # chat streamed: a role chunk for each choice, each choice's text whole
    chunks = list(client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=11, temperature=0,
                                                 n=2, stream=True))
    texts, finish = _by_index(chunks, lambda ch: ch.delta.content)
    assert texts == {0: expected, 1: expected} and set(finish) == {0, 1}
    roles = [ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"]
    assert roles == [0, 1]


def test_several_prompts_with_n_and_echo_streamed(server, hf):
    model, tok = hf
    prompts = ["Names refer to", "The assignment statement"]
    want = [hf_text(hf, tok(p)["input_ids"], 9)[0] for p in prompts]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model="chat-qwen", prompt=prompts, n=2, max_tokens=9, temperature=0,
                                      echo=True)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [p + w for p, w in zip(prompts, want) for _ in range(2)]
    chunks = list(client.completions.create(model="chat-qwen", prompt=prompts, n=2, max_tokens=9, temperature=0,
                                            echo=True, stream=True, stream_options={"include_usage": True}))
    texts, finish = _by_index(chunks, lambda ch: ch.text)
    assert [texts[k] for k in range(4)] == [c.text for c in whole.choices]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == sum(len(tok(p)["input_ids"])
                                                                               for p in prompts)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    ids = tok(prompts[1])["input_ids"]  # token prompts echo their decoded text
    r = client.completions.create(model="chat-qwen", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith(tok.decode(ids, skip_special_tokens=True))


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, hf):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1): the prompt's tokens
    with transformers' FP32 log-probabilities, the first without one; streamed the same."""
    model, tok = hf
    context, continuation = "Assignment statements are used to", " bind names to values"
    ids = tok(context + continuation)["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    want = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    kw = dict(model="chat-qwen", prompt=context + continuation, max_tokens=1, temperature=0, echo=True, logprobs=1)
    r = client.completions.create(**kw)
    lps = r.choices[0].logprobs
    assert r.choices[0].text.startswith(context + continuation)
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert len(lps.tokens) == len(ids) + 1 == len(lps.text_offset)  # the prompt, then the one generated token
    assert lps.text_offset[len(ids)] == len(context + continuation)
    greedy = [max(d, key=d.get) for d in lps.top_logprobs[1:len(ids)]]
    assert greedy == [tok.decode([int(t)]) for t in lp[:-1].argmax(-1)]
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert streamed[0].token_logprobs[0] is None
    assert streamed[0].token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_completion_top_logprobs_always_hold_the_sampled_token(client):
    """OpenAI's legacy completions: "the API will always return the logprob of the sampled token, so there may
    be up to logprobs+1 elements" (vLLM the same): a sampled token outside the top k is added to its entry."""
    kw = dict(model="chat-qwen", prompt="Assignment statements are used to", max_tokens=12, temperature=1.8,
              seed=11)
    for k in (0, 2):
        for stream in (False, True):
            if stream:
                parts = [c.choices[0].logprobs for c in client.completions.create(**kw, logprobs=k, stream=True)
                         if c.choices and c.choices[0].logprobs]
                tokens = [t for p in parts for t in p.tokens]
                lps = [v for p in parts for v in p.token_logprobs]
                tops = [d for p in parts for d in p.top_logprobs]
            else:
                got = client.completions.create(**kw, logprobs=k).choices[0].logprobs
                tokens, lps, tops = got.tokens, got.token_logprobs, got.top_logprobs
            assert len(tokens) == len(tops) == 12
            for token, lp, top in zip(tokens, lps, tops):
                assert top[token] == pytest.approx(lp), (k, stream, token, top)
                assert k <= len(top) <= k + 1
            if k == 2 and not stream:  # at this temperature some draw is outside the top 2
                assert any(len(top) == 3 for top in tops), tops


def test_streamed_text_offsets_equal_the_whole_answers(client):
    """Text held back while it may begin a stop string reaches the client later than its tokens' log-
    probabilities: the stream's offsets still count each token's text, as the whole answer's do."""
    kw = dict(model="chat-qwen", prompt="Assignment statements are used to", max_tokens=16, temperature=1.5,
              seed=5, logprobs=1, stop=[" zzzq", "e zzzq", "a zzzq"])
    whole = client.completions.create(**kw).choices[0]
    parts = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    streamed = [o for c in parts if c.logprobs for o in c.logprobs.text_offset]
    assert "".join(c.text for c in parts) == whole.text
    assert any(len(c.text) < sum(map(len, c.logprobs.tokens)) for c in parts if c.logprobs), \
        "nothing was held back: the test shows nothing"
    assert streamed == whole.logprobs.text_offset


def test_logit_bias_equals_transformers_sequence_bias(client, hf):
    model, tok = hf
    ids = tok("The assignment of")["input_ids"]
    plain = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids):]
    # bias against the tokens the unbiased answer takes at steps 1 and 3 (a change a ban would not show)
    bias = {int(plain[1]): -3.0, int(plain[3]): -2.5, int(plain[0]): 1.5}
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                         sequence_bias={(t,): b for t, b in bias.items()})[0, len(ids):]
    assert ref.tolist() != plain.tolist()
    r = client.completions.create(model="chat-qwen", prompt=ids, max_tokens=12, temperature=0,
                                  logit_bias={str(t): b for t, b in bias.items()}, logprobs=0)
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    # a ban (-100) of a token the answer takes, with a repetition penalty applied after the bias
    banned = {(int(plain[2]),): -100.0}
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                         sequence_bias=banned, repetition_penalty=1.3)[0, len(ids):]
    assert int(plain[2]) not in ref.tolist()
    r = client.completions.create(model="chat-qwen", prompt=ids, max_tokens=12, temperature=0,
                                  logit_bias={str(int(plain[2])): -100}, extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)


def test_fields_surge_cannot_honour_are_refused_and_tools_render(server, hf):
    msg = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for body, param in [({"messages": msg, "response_format": {"type": "json_schema"}}, "response_format"),
                        ({"messages": msg, "tools": [tool]}, "tool_choice"),
                        ({"messages": msg, "tools": [tool], "tool_choice": "required"}, "tool_choice"),
                        ({"messages": msg, "tool_choice": {"type": "function"}}, "tool_choice"),
                        ({"messages": msg, "logit_bias": {"x": 1}}, "logit_bias"),
                        ({"messages": msg, "logit_bias": {"5": 101}}, "logit_bias"),
                        ({"messages": msg, "modalities": ["text", "audio"]}, "modalities"),
                        ({"messages": msg, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                        ({"messages": msg, "web_search_options": {}}, "web_search_options"),
                        ({"messages": msg, "functions": [tool["function"]]}, "functions"),
                        ({"messages": msg, "function_call": "auto"}, "function_call"),
                        ({"messages": msg, "reasoning_effort": "high"}, "reasoning_effort")]:  # no parser
        r = _post(server.url + "/v1/chat/completions", json={"model": "chat-qwen", "max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    # tool_choice "none": the tools rendered into the prompt by the template, as transformers renders them
    ids = hf[1].apply_chat_template(CHAT, tools=[tool], tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    r = _post(server.url + "/v1/chat/completions", json={"model": "chat-qwen", "messages": CHAT, "max_tokens": 8,
                                                          "temperature": 0, "tools": [tool], "tool_choice": "none",
                                                          "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["message"]["content"] == hf_text(hf, ids, 8)[0]
    r = _post(server.url + "/v1/completions", json={"model": "chat-qwen", "prompt": "x", "n": 129})
    assert r.status_code == 422


def test_stop_strings_cut_exactly(client, hf):
    full = client.completions.create(model="chat-qwen", prompt="The target", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = re.findall(r"\S{2,}", full[6:])
    assert words, f"no word to stop at in {full!r}"
    stop = words[0]
    cut = client.completions.create(model="chat-qwen", prompt="The target", max_tokens=40, temperature=0,
                                    stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].stop_reason == stop  # vLLM's field: which stop ended it
    streamed = list(client.completions.create(model="chat-qwen", prompt="The target", max_tokens=40, temperature=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: full.index(stop)]
    assert [c.choices[0].stop_reason for c in streamed if c.choices and c.choices[0].finish_reason] == [stop]
    # a stop token: its id (transformers' third greedy token); the length: none
    model, tok = hf
    prompt = tok("The target")["input_ids"]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=0)[0, len(prompt):]
    by_token = client.completions.create(model="chat-qwen", prompt="The target", max_tokens=40, temperature=0,
                                         extra_body={"ignore_eos": True, "stop_token_ids": [int(out[2])]})
    assert by_token.choices[0].finish_reason == "stop" and by_token.choices[0].stop_reason == int(out[2])
    assert by_token.choices[0].text == tok.decode(out[:2], skip_special_tokens=True)
    first = client.completions.create(model="chat-qwen", prompt="The target", max_tokens=1, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert first.choices[0].finish_reason == "length" and first.choices[0].stop_reason is None
    # vLLM's min_tokens: a stop string inside the first 40 tokens' text does not end the answer
    whole = client.completions.create(model="chat-qwen", prompt="The target", max_tokens=40, temperature=0,
                                      stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 40})
    assert whole.choices[0].text == full and whole.usage.completion_tokens == 40
    r = _post(client.base_url.join("completions").__str__(), json={"prompt": "x", "max_tokens": 3, "min_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_seeded_sampling_is_reproducible_and_logprobs(client):
    a = client.completions.create(model="chat-qwen", prompt="Assign", max_tokens=20, temperature=1.0, top_p=0.95,
                                  seed=42, extra_body={"ignore_eos": True})
    # one more token: another cache key, so this is sampled again, and must start the same way
    b = client.completions.create(model="chat-qwen", prompt="Assign", max_tokens=21, temperature=1.0, top_p=0.95,
                                  seed=42, extra_body={"ignore_eos": True})
    assert b.choices[0].text.startswith(a.choices[0].text)
    c = client.completions.create(model="chat-qwen", prompt="Assign", max_tokens=20, temperature=1.0, top_p=0.95,
                                  seed=7, extra_body={"ignore_eos": True})
    assert c.choices[0].text != a.choices[0].text
    r = client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy takes the best


def test_generation_cache_answers_repeats(server, client):
    before = metric(server, "surge_generate_cache_hits_total")
    kw = dict(model="chat-qwen", prompt="Names are bound", max_tokens=16, temperature=0)
    first = client.completions.create(**kw).choices[0].text
    again = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert first == again == streamed
    assert metric(server, "surge_generate_cache_hits_total") == before + 2


def test_the_generation_cache_is_shared_on_redis(model_dir, hf, redis_server):
    """Two servers with one `--redis-url`: a greedy answer (and a seeded one) computed by one is answered
    from the shared tier by the other, whole and streamed, with every prompt token counted cached, and
    equals transformers'; a sampled answer without a seed is never cached."""
    args = ("--threads", "1", "--redis-url", redis_server)
    with ServerProcess(str(model_dir), *args) as a, ServerProcess(str(model_dir), *args) as b:
        ca, cb = (openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120) for s in (a, b))
        kw = dict(model="chat-qwen", messages=CHAT, max_tokens=16, temperature=0)
        first = ca.chat.completions.create(**kw)
        assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens  # computed
        before = metric(b, "surge_generate_cache_hits_total")
        other = cb.chat.completions.create(**kw)
        assert other.choices[0].message.content == first.choices[0].message.content
        assert other.usage.prompt_tokens_details.cached_tokens == other.usage.prompt_tokens  # from the tier
        chunks = list(cb.chat.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            first.choices[0].message.content
        assert metric(b, "surge_generate_cache_hits_total") == before + 2
        model, tok = hf
        ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert first.choices[0].message.content == hf_text(hf, list(ids), 16)[0]
        seeded = dict(model="chat-qwen", prompt="Names are", max_tokens=8, temperature=0.9, seed=7, logprobs=2)
        sa = ca.completions.create(**seeded)
        sb = cb.completions.create(**seeded)
        assert sb.choices[0].text == sa.choices[0].text and sb.choices[0].logprobs == sa.choices[0].logprobs
        assert sb.usage.prompt_tokens_details.cached_tokens == sb.usage.prompt_tokens
        free = dict(model="chat-qwen", prompt="Names are", max_tokens=8, temperature=0.9)
        ca.completions.create(**free)
        assert cb.completions.create(**free).usage.prompt_tokens_details.cached_tokens < sb.usage.prompt_tokens


def test_kserve_statistics_count_generations(server, client):
    """GET /v2/models/{m}/stats and gRPC ModelStatistics of a decoder model: each generation is one
    inference (HTTP OpenAI / KServe, streamed or not), a cache hit is no execution, a failure counts
    as one, and the stages are the queue (until admitted), the prefill (compute_input, to the first
    token) and the decode (compute_infer)."""
    import grpc

    from surge.server.grpc import grpc_service_pb2 as pb
    from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc

    def stats():
        r = _get(server.url + "/v2/models/chat-qwen/stats")
        assert r.status_code == 200, r.text
        (m,) = r.json()["model_stats"]
        return m

    def diff(a, b, *path):
        for key in path:
            a, b = a[key], b[key]
        return b - a

    before = stats()
    tag = f"{time.time_ns()}"  # prompts never seen: computed, not cached
    client.chat.completions.create(model="chat-qwen", messages=[{"role": "user", "content": f"stats {tag}"}],
                                   max_tokens=8, temperature=0)
    streamed = client.completions.create(model="chat-qwen", prompt=f"stream {tag}", max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) is not None
    # ignore_eos: a random-weight model may end a prompt with EOS early; the stream must run to "length"
    body = {"text_input": f"kserve {tag}", "parameters": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}
    assert _post(server.url + "/v2/models/chat-qwen/generate", json=body).status_code == 200
    with _stream("POST", server.url + "/v2/models/chat-qwen/generate_stream",
                      json={**body, "text_input": f"kserve stream {tag}"}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]  # read to the end
        assert r.status_code == 200 and '"finish_reason":"length"' in events[-1].replace(" ", "")
    assert _post(server.url + "/v2/models/chat-qwen/generate", json=body).status_code == 200  # cached
    too_long = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError):
        too_long.chat.completions.create(model="chat-qwen", messages=[{"role": "user", "content": "word " * 600}],
                                         max_tokens=4)
    after = stats()
    assert diff(before, after, "inference_count") == 5
    assert diff(before, after, "execution_count") == 4
    assert diff(before, after, "inference_stats", "success", "count") == 5
    assert diff(before, after, "inference_stats", "fail", "count") == 1
    assert diff(before, after, "inference_stats", "cache_hit", "count") == 1
    assert diff(before, after, "inference_stats", "cache_miss", "count") == 4
    for stage in ("queue", "compute_input", "compute_infer"):
        assert diff(before, after, "inference_stats", stage, "count") == 4, stage
    for stage in ("compute_input", "compute_infer", "success"):
        assert diff(before, after, "inference_stats", stage, "ns") > 0, stage
    # the decode of 8 tokens takes longer than nothing, and the whole request longer than its stages
    s = after["inference_stats"]
    assert s["success"]["ns"] >= s["compute_input"]["ns"] + s["compute_infer"]["ns"]
    assert after["last_inference"] > 0 and after["last_inference"] >= before["last_inference"]
    with grpc.insecure_channel(server.grpc_url) as channel:
        res = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest(name="chat-qwen"))
    (m,) = res.model_stats
    assert (m.name, m.version) == ("chat-qwen", "1")
    assert m.inference_count == after["inference_count"] and m.execution_count == after["execution_count"]
    for stage in ("success", "fail", "cache_hit", "queue", "compute_input", "compute_infer"):
        got = getattr(m.inference_stats, stage)
        assert (got.count, got.ns) == (s[stage]["count"], s[stage]["ns"]), stage


def test_kserve_generate_and_generate_stream(server, client):
    text = client.completions.create(model="chat-qwen", prompt="The target list", max_tokens=12,
                                     temperature=0).choices[0].text
    r = _post(server.url + "/v2/models/chat-qwen/generate",
                   json={"text_input": "The target list", "parameters": {"max_tokens": 12, "temperature": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text_output"] == text and body["model_name"] == "chat-qwen" and body["model_version"] == "1"
    import json

    with _stream("POST", server.url + "/v2/models/chat-qwen/versions/1/generate_stream",
                      json={"text_input": "The target list", "max_tokens": 12, "temperature": 0}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == text
    assert events[-1]["finish_reason"] in ("length", "stop")
    meta = _get(server.url + "/v2/models/chat-qwen")
    assert meta.status_code == 200 and meta.json()["inputs"][0]["name"] == "text_input"
    infer = _post(server.url + "/v2/models/chat-qwen/infer",
                       json={"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]})
    assert infer.status_code == 400 and "generate" in infer.json()["error"]
    bad = _post(server.url + "/v2/models/nope/generate", json={"text_input": "x"})
    assert bad.status_code == 404 and "error" in bad.json()
    # vLLM's sampling extras in the generate extension's parameters too
    r = _post(server.url + "/v2/models/chat-qwen/generate", json={"text_input": "The target list", "parameters": {
        "max_tokens": 2, "min_tokens": 2, "ignore_eos": True, "temperature": 0, "allowed_token_ids": [7]}})
    assert r.status_code == 200 and r.json()["completion_tokens"] == 2, r.text
    assert r.json()["text_output"] == client.completions.create(
        model="chat-qwen", prompt="The target list", max_tokens=2, temperature=0,
        extra_body={"allowed_token_ids": [7], "ignore_eos": True}).choices[0].text


def test_bad_requests_get_clear_errors(server, client):
    url = server.url
    r = _post(url + "/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and "serves task 'generate'" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "wrong_task", r.text  # as an embedding route on a classifier
    # TEI's routes of another task are its 424 Backend error, /similarity too (it was 422 Validation)
    for path, body in (("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
                       ("/embed_all", {"inputs": "a"}), ("/rerank", {"query": "a", "texts": ["b"]})):
        r = _post(url + path, json=body)
        assert (r.status_code, r.json()) == (424, {"error": "model 'chat-qwen' serves task 'generate', not "
                                                            f"'{'rerank' if path == '/rerank' else 'embed'}'",
                                                   "error_type": "Backend"}), (path, r.text)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=2)
    r = _post(url + "/v1/chat/completions", json={"messages": CHAT, "temperature": 7})
    assert r.status_code == 422 and "temperature" in r.json()["error"]["message"]
    r = _post(url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 422
    # other modalities are a 400 naming them (was 422 "invalid field 'messages.0.content.str': Input should be
    # a valid string"), on the chat route and vLLM's /tokenize
    image = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = _post(url + path, json={"model": "chat-qwen", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (path, r.text)
        assert "'image_url'" in r.json()["error"]["message"] and "only text" in r.json()["error"]["message"], r.text
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "x"})):
        r = _post(url + path, json={"model": "chat-qwen", "stop": 5, **body})
        assert r.status_code == 422 and r.json()["error"]["message"] == (
            "invalid field 'stop': expected a string or a list of strings"), (path, r.text)
    for prompt in (5, None, [[1, 2], "mixed"], [1.5], {"a": 1}):  # one sentence, not "'prompt.str': ... string"
        r = _post(url + "/v1/completions", json={"model": "chat-qwen", "prompt": prompt})
        assert r.status_code == 422 and r.json()["error"]["message"] == (
            "invalid field 'prompt': expected a string, a list of strings, a list of token ids, or a list of "
            "token-id lists"), (prompt, r.text)
    r = _post(url + "/v1/completions", json={"prompt": "x " * 400, "max_tokens": 2})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = _post(url + "/v1/completions", json={"prompt": [10 ** 6], "max_tokens": 2})
    assert r.status_code == 400
    models = client.models.list()
    assert [m.id for m in models.data] == ["chat-qwen"]
    assert "/v1/chat/completions" in _get(url + "/openapi.json").json()["paths"]
    # LoRA: no slots, and loading while serving is off unless allowed (vLLM's routes)
    r = _post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert r.status_code == 400 and "LoRA slots: none" in r.json()["error"]["message"]
    r = _post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp", "model": "chat-qwen"})
    assert r.status_code == 501 and "allow_runtime_lora" in r.json()["error"]["message"]
    r = _post(url + "/v1/unload_lora_adapter", json={"lora_name": "chat-qwen"})
    assert r.status_code == 404


def test_tei_tokenize_decode_and_info_of_a_decoder(server, hf):
    model, tok = hf
    text = "Assignment statements rebind names"
    r = _post(server.url + "/tokenize", json={"inputs": [text, "x"], "add_special_tokens": False})
    assert r.status_code == 200, r.text
    first = r.json()[0]
    assert [t["id"] for t in first] == tok(text, add_special_tokens=False)["input_ids"]
    assert "".join(text[t["start"]:t["stop"]] for t in first) == text
    ids = tok(text)["input_ids"]
    r = _post(server.url + "/decode", json={"ids": [ids, ids[:2]]})
    assert r.json() == [tok.decode(ids, skip_special_tokens=True), tok.decode(ids[:2], skip_special_tokens=True)]
    assert _post(server.url + "/decode", json={"ids": [10 ** 6]}).status_code == 422  # TEI's Validation
    info = _get(server.url + "/info").json()
    assert info["task"] == "generate" and info["model_id"] == "chat-qwen"
    assert info["max_input_length"] == model.config.max_position_embeddings
    assert info["model_type"]["generate"]["chat_template"] is True
    # the checkpoint's architecture and TEI's dtype names, as an encoder's /info gives them
    assert info["architecture"] == type(model).__name__ == "Qwen2ForCausalLM"
    assert info["model_dtype"] == "float32"


def test_kserve_infer_as_tritons_vllm_backend_takes_it(server, hf):
    """tritonclient (HTTP and gRPC, unary and a decoupled stream) against a decoder model with the
    vLLM backend's tensors: text_input, sampling_parameters, stream, exclude_input_in_output, return_*."""
    import queue

    import tritonclient.grpc as tg
    import tritonclient.http as th

    model, tok = hf
    prompt = "The augmented assignment"
    want, n = hf_text(hf, tok(prompt)["input_ids"], 10)
    sampling = {"max_tokens": 10, "temperature": 0}
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    r = http.infer("chat-qwen", vllm_backend_inputs(th, prompt, sampling, return_finish_reason=True,
                                               return_num_input_tokens=True, return_num_output_tokens=True))
    assert r.as_numpy("text_output")[0].decode() == prompt + want  # the prompt first, as the vLLM backend
    assert r.as_numpy("finish_reason")[0].decode() == ("length" if n == 10 else "stop")
    assert int(r.as_numpy("num_input_tokens")[0]) == len(tok(prompt)["input_ids"])
    assert int(r.as_numpy("num_output_tokens")[0]) == n
    r = http.infer("chat-qwen", vllm_backend_inputs(th, prompt, sampling, exclude_input_in_output=True),
                   outputs=[th.InferRequestedOutput("text_output", binary_data=False)])
    assert r.as_numpy("text_output")[0] in (want, want.encode())  # JSON data: tritonclient may keep the str
    with pytest.raises(Exception, match="ModelStreamInfer"):
        http.infer("chat-qwen", vllm_backend_inputs(th, prompt, sampling, stream=True))
    r = http.infer("chat-qwen", vllm_backend_inputs(th, prompt, sampling, return_num_output_tokens=True),
                   outputs=[th.InferRequestedOutput("num_output_tokens")])  # only the output named
    assert [o["name"] for o in r.get_response()["outputs"]] == ["num_output_tokens"]
    with pytest.raises(Exception, match="return_finish_reason"):
        http.infer("chat-qwen", vllm_backend_inputs(th, prompt, sampling),
                   outputs=[th.InferRequestedOutput("finish_reason")])

    grpc_client = tg.InferenceServerClient(server.grpc_url)
    r = grpc_client.infer("chat-qwen", vllm_backend_inputs(tg, prompt, sampling, exclude_input_in_output=True,
                                                      return_num_input_tokens=True),
                          outputs=[tg.InferRequestedOutput("text_output")])
    assert r.as_numpy("text_output")[0].decode() == want
    assert [o.name for o in r.get_response().outputs] == ["text_output"]
    with pytest.raises(Exception, match="'nope' is not produced"):
        grpc_client.infer("chat-qwen", vllm_backend_inputs(tg, prompt, sampling),
                          outputs=[tg.InferRequestedOutput("nope")])
    got: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        grpc_client.async_stream_infer("chat-qwen", vllm_backend_inputs(tg, prompt, sampling, stream=True),
                                       request_id="s1")
        pieces, finals = [], []
        while not finals or not finals[-1]:
            result, error = got.get(timeout=60)
            assert error is None, error
            assert result.get_response().id == "s1"
            pieces.append(result.as_numpy("text_output")[0].decode())
            finals.append(result.get_response().parameters["triton_final_response"].bool_param)
        grpc_client.async_stream_infer("chat-qwen", vllm_backend_inputs(tg, prompt, sampling, nope=True),
                                       request_id="bad")
        _, error = got.get(timeout=60)
        assert error is not None and "text_input" in str(error)
    finally:
        grpc_client.stop_stream()
    assert "".join(pieces) == want and finals == [False] * (len(finals) - 1) + [True] and len(pieces) > 1

    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [prompt]},
                       {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES", "data": ["[1]"]}]}
    r = _post(server.url + "/v2/models/chat-qwen/infer", json=body)
    assert r.status_code == 400 and "sampling_parameters" in r.json()["error"]
    body["inputs"][1]["data"] = ['{"max_tokens": 4, "best_of": 2}']  # a vLLM field surge does not honour
    r = _post(server.url + "/v2/models/chat-qwen/infer", json=body)
    assert r.status_code == 400 and "'best_of' is not supported" in r.json()["error"]
    body["inputs"][1]["data"] = ['{"max_tokens": 3, "min_tokens": 3, "ignore_eos": true, "allowed_token_ids": [7]}']
    r = _post(server.url + "/v2/models/chat-qwen/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"][0] == prompt + hf[1].decode([7, 7, 7])
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [prompt]}]}
    r = _post(server.url + "/v2/models/chat-qwen/infer", json=body)
    assert r.status_code == 400 and "text_input" in r.json()["error"]


def test_client_disconnect_frees_kv_blocks(server):
    aborted = metric(server, "surge_generate_requests_total", finish_reason="abort")
    body = {"model": "chat-qwen", "prompt": "Assignment", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True, "seed": 5}
    with _stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
    assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(server, "surge_generate_requests_total", finish_reason="abort") > aborted \
                and metric(server, "surge_generate_running_sequences") == 0:
            break
        time.sleep(0.05)
    assert metric(server, "surge_generate_requests_total", finish_reason="abort") == aborted + 1
    assert metric(server, "surge_generate_running_sequences") == 0
    assert metric(server, "surge_generate_kv_cache_usage_ratio") == 0.0
    assert metric(server, "surge_generate_output_tokens_total") > 0
    assert metric(server, "surge_generate_time_to_first_token_seconds_count") > 0


def test_full_queue_gets_429_and_deadline_504(slow_model_dir):
    env = {"SURGE_GENERATION_MAX_WAITING": "1", "SURGE_GENERATION_CACHE_ENTRIES": "0"}
    with ServerProcess(str(slow_model_dir), "--threads", "1", "--max-batch-size", "1", "--request-timeout-s", "0.3",
                       env=env) as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                body = {"prompt": "Assignment is", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))

        responses = asyncio.run(main())
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and 504 in codes, codes
        limited = next(r for r in responses if r.status_code == 429)
        assert int(limited.headers["retry-after"]) >= 1 and limited.json()["error"]["type"] == "rate_limit_error"
        assert next(r for r in responses if r.status_code == 504).json()["error"]["code"] == "timeout"


@pytest.mark.parametrize("engine_process", [False, True])
def test_repository_versions_and_zero_downtime_reload(tmp_path, model_dir, engine_process):
    """A stream in flight finishes on version 1 while version 2 loads and takes the traffic; with the engine
    loop in its own process (model.yaml's generation section), version 1's engine process ends after it."""
    import shutil

    import psutil

    root = tmp_path / "repo"
    (root / "chat" / "1").mkdir(parents=True)
    (root / "chat" / "1" / "model.yaml").write_text(f"source: {model_dir}\nengine:\n  threads: 1\n"
                                                    f"generation:\n  engine_process: {str(engine_process).lower()}\n")

    def engines(srv):
        return [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)
                if "surge.runtime.generate_process" in " ".join(p.cmdline())]

    with ServerProcess("--model-repository", str(root)) as srv:
        before = engines(srv)
        assert len(before) == int(engine_process)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="chat", prompt="The target", max_tokens=150, temperature=0, extra_body={"ignore_eos": True})
        reference = client.completions.create(**kw).choices[0].text
        stream = client.completions.create(**kw, stream=True)
        first = next(iter(stream))  # a stream in flight on version 1
        shutil.copytree(root / "chat" / "1", root / "chat" / "2")
        r = _post(srv.url + "/models/chat/reload", timeout=60)
        assert r.status_code == 200, r.text
        rest = "".join(c.choices[0].text for c in stream if c.choices)
        assert first.choices[0].text + rest == reference  # finished on the old version, whole
        after = _post(srv.url + "/v1/completions", json={**{k: v for k, v in kw.items() if k != "extra_body"},
                                                             "ignore_eos": True, "max_tokens": 5})
        assert after.status_code == 200 and after.headers["x-surge-model-version"] == "2"
        deadline = time.monotonic() + 30
        while engine_process and len(engines(srv)) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        now = engines(srv)
        assert len(now) == int(engine_process) and not set(now) & set(before)


def test_non_streamed_request_is_aborted_when_the_client_leaves(server):
    aborted = metric(server, "surge_generate_requests_total", finish_reason="abort")
    body = {"model": "chat-qwen", "prompt": "Names", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "seed": 11}
    with pytest.raises(httpx.TimeoutException):
        _post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.05))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
            metric(server, "surge_generate_requests_total", finish_reason="abort") == aborted
            or metric(server, "surge_generate_running_sequences") != 0):
        time.sleep(0.05)
    assert metric(server, "surge_generate_requests_total", finish_reason="abort") == aborted + 1
    assert metric(server, "surge_generate_running_sequences") == 0


def test_the_engine_loop_in_its_own_process(model_dir, hf):
    """`--generation engine_process=true` (the default on a GPU): the server's answers are transformers',
    a stream's concatenation is the answer, the engine runs in one child process, and killing the
    server alone (no signal to its group) leaves no engine process behind."""
    import os
    import signal

    import psutil

    model, tok = hf
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "engine_process=true,cache_entries=0") as srv:
        children = [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
                    if "surge.runtime.generate_process" in " ".join(p.cmdline())]
        assert len(children) == 1
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        expected, n = hf_text(hf, ids, 24)
        r = client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == expected and r.usage.completion_tokens == n
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=24, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        # the prefix cache's count crosses from the engine process: the prompt's whole blocks but the last token's
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
        assert metric(srv, "surge_generate_output_tokens_total") >= 2 * n
        os.kill(srv.proc.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive


def test_a_dead_engine_process_is_started_again(model_dir, hf):
    """SIGKILL on the engine process: a stream in flight ends at once with an error event, /ready answers
    503 and new requests 503 while a new engine process loads; then the server answers again
    (transformers' text) with one restart counted."""
    import os
    import signal

    import psutil

    def engine_children(srv):
        return [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
                if "surge.runtime.generate_process" in " ".join(p.cmdline())]

    model, tok = hf
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "engine_process=true,cache_entries=0") as srv:
        (child,) = engine_children(srv)
        assert _get(srv.url + "/ready").status_code == 200
        body = {"model": "chat-qwen", "prompt": "Assignment", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with _stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(child.pid, signal.SIGKILL)
            rest = list(lines)  # ends with the exit's error event, not the request timeout's: no clock needed
        assert any("engine process exited" in line for line in rest), rest[-3:]
        assert _get(srv.url + "/ready").status_code == 503
        r = _post(srv.url + "/v1/completions", json={"model": "chat-qwen", "prompt": "Assignment", "max_tokens": 4})
        assert r.status_code == 503, r.text
        deadline = time.monotonic() + 90
        while _get(srv.url + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        ids = tok("Assignment is defined")["input_ids"]
        expected, _ = hf_text(hf, ids, 16)
        r = _post(srv.url + "/v1/completions", json={"model": "chat-qwen", "prompt": "Assignment is defined",
                                                     "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        assert [p.pid for p in engine_children(srv)] != [child.pid]
        assert metric(srv, "surge_generate_engine_restarts_total") == 1


def test_vllm_sampling_extras(client, hf):
    """allowed_token_ids, skip_special_tokens, include_stop_str_in_output, truncate_prompt_tokens (vLLM's
    names; silently ignored before)."""
    tok = hf[1]
    start = tok.convert_tokens_to_ids("<|im_start|>")
    common = {"model": "chat-qwen", "prompt": "The target", "max_tokens": 3, "temperature": 0}
    r = client.completions.create(**common, extra_body={"allowed_token_ids": [start], "ignore_eos": True,
                                                        "skip_special_tokens": False})
    assert r.choices[0].text == "<|im_start|>" * 3
    r = client.completions.create(**common, extra_body={"allowed_token_ids": [start], "ignore_eos": True})
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**common, extra_body={"allowed_token_ids": [10 ** 6]})
    assert err.value.body["param"] == "allowed_token_ids"
    full = client.completions.create(model="chat-qwen", prompt="The target", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    word = next(w for w in full.split() if len(w) > 2)
    banned = client.completions.create(model="chat-qwen", prompt="The target", max_tokens=30, temperature=0,
                                       extra_body={"ignore_eos": True, "bad_words": [word]})
    assert banned.choices[0].text != full  # the word's tokens (engine test: tests/unit/test_decoder_engine.py)
    kept = client.completions.create(model="chat-qwen", prompt="The target", max_tokens=30, temperature=0,
                                     stop=[word], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(word) + len(word)]
    ids = [int(t) for t in torch.randint(5, 300, (40,), generator=torch.Generator().manual_seed(2))]
    cut = client.completions.create(model="chat-qwen", prompt=ids, max_tokens=8, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 12, "ignore_eos": True})
    assert cut.usage.prompt_tokens == 12
    assert cut.choices[0].text == client.completions.create(model="chat-qwen", prompt=ids[-12:], max_tokens=8,
                                                            temperature=0, extra_body={"ignore_eos": True}
                                                            ).choices[0].text


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options=opts, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 12
    streamed = list(client.completions.create(model="chat-qwen", prompt=["The", "A target"], n=2, max_tokens=6,
                                              temperature=0.8, seed=3, stream=True, stream_options=opts,
                                              extra_body={"ignore_eos": True}))
    finals = [c for c in streamed if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 4 and all(c.usage.completion_tokens == 6 for c in finals)
    assert streamed[-1].usage.completion_tokens == 24  # the last chunk: the whole request's


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(client, hf):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 for a prompt never seen, then its whole
    16-token blocks but the last token's (the prefix cache's rule), whole and streamed, chat and
    completions. Sampled without a seed, so the generation cache never answers them."""
    import uuid

    _, tok = hf
    # a prompt no other test sent, from its first block on (the default system prompt is everyone's)
    words = " ".join(uuid.uuid4().hex[:6] for _ in range(12))
    messages = [{"role": "system", "content": words}, {"role": "user", "content": "Define it."}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    whole_blocks = (len(ids) - 1) // 16 * 16
    assert whole_blocks >= 16
    first = client.chat.completions.create(model="chat-qwen", messages=messages, max_tokens=4, temperature=0.9)
    assert first.usage.prompt_tokens == len(ids) and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="chat-qwen", messages=messages, max_tokens=4, temperature=0.9)
    assert again.usage.prompt_tokens_details.cached_tokens == whole_blocks
    chunks = list(client.chat.completions.create(model="chat-qwen", messages=messages, max_tokens=4, temperature=0.9,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole_blocks
    prompt = " ".join(uuid.uuid4().hex[:6] for _ in range(12))
    once = client.completions.create(model="chat-qwen", prompt=prompt, max_tokens=2, temperature=0.9)
    assert once.usage.prompt_tokens_details.cached_tokens == 0
    twice = client.completions.create(model="chat-qwen", prompt=[prompt], max_tokens=2, temperature=0.9)
    assert twice.usage.prompt_tokens_details.cached_tokens == (once.usage.prompt_tokens - 1) // 16 * 16 >= 16


def test_w8a8_is_served_and_answers_as_transformers_on_the_same_products(model_dir, hf):
    """`--generation quantization=w8a8` (the CPU's INT8 products) through `surge serve`: the openai client's greedy
    chat answer, whole and streamed, is transformers' with every linear and the LM head computing the same W8A8
    product (tests/unit/test_decoder_w8a8.py's reference), and so are its tokens' log-probabilities, which the
    full-precision model's miss by far more (this prompt's text is the same for both)."""
    from tests.unit.test_decoder_w8a8 import _patched_hf

    def chosen_logprobs(model, ids, n):
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        return [torch.log_softmax(sc[0].double(), -1).max().item() for sc in out.scores]

    _, tok = hf
    ref = (_patched_hf(model_dir, "qwen2"), tok)
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected, n = hf_text(ref, ids, 24)
    want_lp, plain_lp = chosen_logprobs(ref[0], ids, n), chosen_logprobs(hf[0], ids, n)
    assert max(abs(a - b) for a, b in zip(want_lp, plain_lp)) > 1e-2
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "quantization=w8a8,cache_entries=0") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=24, temperature=0,
                                           logprobs=True)
        assert r.choices[0].message.content == expected and r.usage.completion_tokens == n
        got_lp = [t.logprob for t in r.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 2e-3, (got_lp, want_lp)
        chunks = list(client.chat.completions.create(model="chat-qwen", messages=CHAT, max_tokens=24, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
