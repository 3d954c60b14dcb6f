"""A decoder model's warm-up generation is no client's request: a real `surge serve`, a real httpx client.

The repository runs one short generation through the whole path before traffic reaches a build (at start,
and at each reload). /metrics must not show it: right after start, and right after a reload, the
`surge_generate_*` request, token and latency series are where the clients left them, and one client
request then counts exactly once.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("torch")

from tests.decoder_models import build_model  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

MODEL = "warm-qwen"
# every series a generation request adds to (the engine-wide gauges and prefix-cache counters are left
# out: that work was done, and they say so)
SERIES = ("surge_generate_requests_total", "surge_generate_time_to_first_token_seconds_count",
          "surge_generate_inter_token_latency_seconds_count", "surge_generate_output_tokens_total",
          "surge_generate_prompt_tokens_total", "surge_requests_total", "surge_request_latency_seconds_count")


def counts(url: str) -> dict[str, float]:
    """Each of SERIES summed over MODEL's versions and other labels (finish_reason)."""
    out = dict.fromkeys(SERIES, 0.0)
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.labels.get("model") == MODEL and s.name in out:
                out[s.name] += s.value
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_model("qwen2", tmp_path_factory.mktemp("warm") / MODEL, seed=5, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)
    with ServerProcess(str(model_dir), "--threads", "1") as srv:
        yield srv


def one_request(url: str, prompt_tokens_of: list[int]) -> None:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt_tokens_of, "max_tokens": 3, "ignore_eos": True,
                         "temperature": 0.5})  # sampled without a seed: computed, not from the generation cache
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def assert_one_request(before: dict, after: dict) -> None:
    d = {k: after[k] - before[k] for k in SERIES}
    assert d == {"surge_generate_requests_total": 1, "surge_generate_time_to_first_token_seconds_count": 1,
                 "surge_generate_inter_token_latency_seconds_count": 2, "surge_generate_output_tokens_total": 3,
                 "surge_generate_prompt_tokens_total": 4, "surge_requests_total": 1,
                 "surge_request_latency_seconds_count": 1}


def test_the_warm_up_generation_is_not_counted_at_start_nor_at_reload(server):
    assert counts(server.url) == dict.fromkeys(SERIES, 0.0)  # only the warm-up has run: no client request
    one_request(server.url, [5, 6, 7, 8])
    after_first = counts(server.url)
    assert_one_request(dict.fromkeys(SERIES, 0.0), after_first)

    r = httpx.post(server.url + f"/models/{MODEL}/reload", timeout=300)
    assert r.status_code == 200, r.text
    assert counts(server.url) == after_first  # the new build's warm-up is no request either

    one_request(server.url, [9, 10, 11, 12])
    assert_one_request(after_first, counts(server.url))
