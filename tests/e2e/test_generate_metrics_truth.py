"""/metrics of a decoder model tells what its clients saw: a real `surge serve`, the real `openai` client.

A generation is counted where every other model's request is (`surge_requests_total`, failures by
code, end-to-end latency), so one dashboard's request and error rates cover every model; and a
generation answered from the generation cache still finished, with its reason.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests import metrics_scrape  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402
from tests.metrics_scrape import delta, total  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

MODEL = "chat-qwen"


def scrape(url: str) -> dict[tuple, float]:
    return metrics_scrape.scrape(url, MODEL)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("chatmodel") / MODEL, seed=4, hidden_size=128,
                       intermediate_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_refused_generation_is_a_request_and_a_failure_under_its_code(server, client):
    before = scrape(server.url)
    with pytest.raises(openai.BadRequestError):  # a chat longer than the model's context: refused by the model
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 600}],
                                       max_tokens=4)
    after = scrape(server.url)
    assert delta(before, after, "surge_requests_total") == 1
    assert total(before, after, "surge_request_failures_total") == 1
    assert delta(before, after, "surge_request_failures_total", code="invalid_input") == 1


def test_a_cached_generation_is_counted_as_a_request_that_finished(server, client):
    kw = dict(model=MODEL, prompt=f"Names are bound {time.time_ns()}", max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    before = scrape(server.url)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)  # greedy: answered from the generation cache
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    after = scrape(server.url)
    assert again.choices[0].text == first.choices[0].text == streamed
    assert delta(before, after, "surge_generate_cache_hits_total") == 2
    assert delta(before, after, "surge_requests_total") == 3
    assert total(before, after, "surge_request_failures_total") == 0
    assert delta(before, after, "surge_request_latency_seconds_count") == 3
    assert delta(before, after, "surge_generate_requests_total", finish_reason="length") == 3


SYSTEM = "You are a careful assistant. " * 6  # some whole KV blocks of prompt


def _chats(client, n: int, **extra) -> list:
    """`n` chats that share the system prompt (each its own question): their usage."""
    return [client.chat.completions.create(model=MODEL, max_tokens=2, extra_body=extra or None, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i} {time.time_ns()}"}]).usage
        for i in range(n)]


def test_a_repeated_system_prompt_is_counted_as_prefix_cache_hits(server, client):
    """The prefix cache's counters against the answers' usage: every prompt token looked up (the hit rate's
    denominator: usage.prompt_tokens), the hits those its cached_tokens, which the system prompt's blocks
    give from the second request on."""
    before = scrape(server.url)
    usage = _chats(client, 3)
    after = scrape(server.url)
    hits = sum(u.prompt_tokens_details.cached_tokens for u in usage)
    assert usage[0].prompt_tokens_details.cached_tokens == 0 and hits > 0
    assert delta(before, after, "surge_generate_prefix_cache_hit_tokens_total") == hits
    assert delta(before, after, "surge_generate_prefix_cache_queried_tokens_total") == sum(u.prompt_tokens
                                                                                           for u in usage)


def test_a_prompt_that_skips_the_prefix_cache_is_not_counted_as_looked_up(server, client):
    """A request for prompt_logprobs scores every prompt position, so it never looks its prompt up in the
    prefix cache (cached_tokens 0, with the system prompt's blocks there): its tokens are not part of the
    hit rate's denominator. They were, as misses: the hit rate read low by every such request's prompt."""
    _chats(client, 1)  # the system prompt's blocks are in the cache
    before = scrape(server.url)
    usage = _chats(client, 2, prompt_logprobs=1)
    after = scrape(server.url)
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [0, 0]
    assert delta(before, after, "surge_generate_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert delta(before, after, "surge_generate_prefix_cache_queried_tokens_total") == 0
    assert delta(before, after, "surge_generate_prefix_cache_hit_tokens_total") == 0


def test_with_prefix_caching_off_no_prompt_is_counted_as_looked_up(model_dir):
    """--generation prefix_caching=false: nothing is looked up (a repeated system prompt gets cached_tokens 0),
    so nothing is queried; every prompt token counted as queried made the hit rate a flat 0% where there is
    no cache to hit."""
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "prefix_caching=false") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        before = scrape(srv.url)
        usage = _chats(client, 2)
        after = scrape(srv.url)
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [0, 0]
    assert delta(before, after, "surge_generate_prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert delta(before, after, "surge_generate_prefix_cache_queried_tokens_total") == 0
