"""OpenAI's error body names the error's `type` by its HTTP status, checked with the real openai client
against a real `surge serve --model-repository`: a 400 (an invalid model.yaml, surge's ConfigError) is the
client's error, `invalid_request_error` (openai.BadRequestError), never `server_error`."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("badrepo")
    add_version(root, "bad", 1, "engine: {threads: -1}\n")  # nothing loads: /ready stays 503, /health answers
    srv = ServerProcess("--model-repository", str(root), "--threads", "1")
    srv.ready_path = "/health"
    with srv:
        yield srv


def test_a_config_error_is_a_bad_request_not_a_server_error(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/models/bad/load", cast_to=object)
    err = info.value
    assert err.status_code == 400 and err.code == "invalid_config", err.body
    assert err.type == err.body["type"] == "invalid_request_error", err.body
    assert "bad/1/model.yaml" in err.body["message"]


def test_an_unknown_model_is_not_found_of_the_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="nope", input="hi")
    assert info.value.type == info.value.body["type"] == "invalid_request_error", info.value.body
