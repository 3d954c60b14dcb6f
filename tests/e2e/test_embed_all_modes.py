"""TEI's POST /embed_all in every way `surge serve` runs an embedding model, against real server processes:
one process, `--workers 2` (the engines in another process: the per-token rows cross the IPC), and
`--model-repository` under `--workers 2`. Every connection is a front end's (`--engine-connections 0`), so
that none is served by the engine process itself.

Each answer is checked against transformers' FP32 last_hidden_state; a text's rows do not depend on the
other inputs of its request; an answer larger than --max-token-states-bytes is a 413 before any compute;
a flood is refused with 429 by admission control (--max-inflight), never left to time out.
"""

from __future__ import annotations

import asyncio
import collections

import httpx
import numpy as np
import pytest

from surge.models import bundled_model_dir
from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess, fresh_client

ENGINE = "engine: {threads: 1, warmup_shapes: [[1, 8]]}\n"
LONG = "the quick brown fox jumps over the lazy dog " * 80  # past the model's 256 tokens: truncated
HIDDEN = 384
MAX_TOKEN_STATES = 4 * 256 * HIDDEN * 4  # four full-length inputs' rows (float32)
MAX_INFLIGHT = 8  # inputs admitted at once: two requests of 4


@pytest.fixture(scope="module", params=["one-process", "workers", "workers-repository"])
def server(request, tmp_path_factory):
    common = ["--threads", "1", "--max-inflight", str(MAX_INFLIGHT),
              "--max-token-states-bytes", str(MAX_TOKEN_STATES)]
    if request.param == "one-process":
        args = common
    elif request.param == "workers":
        args = [*common, "--workers", "2", "--engine-connections", "0"]
    else:
        root = tmp_path_factory.mktemp("embedall-repo")
        add_version(root, "all-MiniLM-L6-v2", 1, ENGINE + f"source: {bundled_model_dir()}\n")
        args = [*common, "--model-repository", str(root), "--workers", "2", "--engine-connections", "0"]
    with ServerProcess(*args) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference():
    """transformers FP32: each text's last hidden state, truncated to the model's 256 tokens."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir()))
    model = AutoModel.from_pretrained(str(bundled_model_dir()), dtype=torch.float32).eval()

    def last_hidden_state(text: str) -> np.ndarray:
        enc = tok([text], truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            return model(**enc).last_hidden_state[0].numpy().astype(np.float64)

    return last_hidden_state


def _post(server, body) -> httpx.Response:
    """On a fresh connection each time: under --workers every front end answers some."""
    with fresh_client(server.url, timeout=120) as c:
        return c.post("/embed_all", json=body)


def test_embed_all_is_the_last_hidden_state_of_every_token(server, reference, sentences):
    texts = sentences[:3] + [LONG]
    for _ in range(4):  # several connections: both front ends
        r = _post(server, {"inputs": texts})
        assert r.status_code == 200, r.text
        got = r.json()
        assert len(got) == len(texts)
        for text, rows in zip(texts, got):
            want = reference(text)
            rows = np.asarray(rows, dtype=np.float64)
            assert rows.shape == want.shape  # [tokens incl. [CLS] and [SEP], 384]
            cos = (rows * want).sum(1) / np.linalg.norm(rows, axis=1) / np.linalg.norm(want, axis=1)
            assert cos.min() >= 0.9999, cos.min()
            np.testing.assert_allclose(rows, want, atol=2e-3, rtol=0)
    r = _post(server, {"inputs": LONG, "truncate": False})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation", r.text


def test_a_texts_rows_do_not_depend_on_its_neighbours(server, sentences):
    """The same text alone, beside a long input, and beside other short ones: the same rows."""
    text = sentences[5]
    alone = np.asarray(_post(server, {"inputs": text}).json()[0], dtype=np.float32)
    for inputs in ([LONG, text], [text, sentences[6], sentences[7]], [sentences[8], LONG, text, sentences[9]]):
        r = _post(server, {"inputs": inputs})
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(np.asarray(r.json()[inputs.index(text)], dtype=np.float32), alone)


def test_an_answer_past_the_limit_is_413_before_any_compute(server):
    """Five full-length inputs' rows are more than --max-token-states-bytes (four's): 413, saying what the
    limit is; the server goes on answering."""
    r = _post(server, {"inputs": [LONG] * 5})
    assert r.status_code == 413, r.text[:300]
    body = r.json()
    assert body["error_type"] == "Validation", body
    assert "max-token-states-bytes" in body["error"] and str(MAX_TOKEN_STATES) in body["error"], body
    assert _post(server, {"inputs": [LONG] * 4}).status_code == 200


def test_a_flood_is_refused_with_429_not_queued(server):
    """Many concurrent requests of four long inputs against --max-inflight 8: some are answered, the
    rest refused at once with 429 and Retry-After; none times out or fails otherwise."""
    async def flood(n: int):
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*[c.post("/embed_all", json={"inputs": [LONG] * 4}) for _ in range(n)])

    answers = asyncio.run(flood(24))
    statuses = collections.Counter(r.status_code for r in answers)
    assert set(statuses) <= {200, 429}, [r.text for r in answers if r.status_code not in (200, 429)][:3]
    assert statuses[200] >= 1 and statuses[429] >= 1, statuses
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.json()["error_type"] == "Overloaded" and int(refused.headers["retry-after"]) >= 1
    assert _post(server, {"inputs": "still serving"}).status_code == 200
