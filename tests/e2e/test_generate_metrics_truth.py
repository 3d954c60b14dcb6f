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

from tests.decoder_models import build_model  # noqa: E402
from tests import metrics_scrape  # noqa: E402
from tests.metrics_scrape import delta, total  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

MODEL = "chat-qwen"


def scrape(url: str) -> dict[tuple, float]:
    return metrics_scrape.scrape(url, MODEL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_model("qwen2", tmp_path_factory.mktemp("chatmodel") / MODEL, seed=4, hidden_size=128,
                            intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                            num_key_value_heads=2)
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
