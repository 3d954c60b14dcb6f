"""A request body that fails validation costs about what it weighs, not a thousand times more.

pydantic collects every error of a body before the route reports its first: a 2 MB body of 650,000
`{}` items for `inputs` (a union of four list types) made ~2.6 million errors, 7 s of CPU and +2 GB of
the server's peak memory for one request, and a body of 180,000 unknown keys +195 MB. Lists are now
validated fail-fast and unknown top-level keys are found before pydantic runs (server/http/common.py),
so one error is found and reported. Measured on the real server's peak RSS (VmHWM), each test from its
own baseline, in the order that keeps the smaller case first.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess

HEADERS = {"content-type": "application/json"}
LIMIT_KB = 100 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation_amplification")
    add_version(root, "enc", 1)
    with ServerProcess("--model-repository", str(root), "--threads", "1") as srv:
        yield srv


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def post(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers=HEADERS, timeout=120)


def test_1_many_unknown_keys(server):
    keys = b",".join(b'"k%d":0' % i for i in range(180_000))
    before = peak_rss_kb(server.proc.pid)
    r = post(server, "/embed", b'{"inputs":"x",' + keys + b"}")
    assert r.status_code == 422 and "unknown field 'k0'" in r.text, r.text[:200]
    assert peak_rss_kb(server.proc.pid) - before < LIMIT_KB


@pytest.mark.parametrize("path,field", [("/embed", "inputs"), ("/v1/embeddings", "input"), ("/tokenize", "inputs")])
def test_2_many_invalid_items(server, path, field):
    items = b",".join([b"{}"] * 650_000)
    before = peak_rss_kb(server.proc.pid)
    r = post(server, path, b'{"model":"enc","' + field.encode() + b'":[' + items + b"]}")
    assert r.status_code == 422, r.text[:200]
    assert f"invalid field '{field}'" in r.text, r.text[:200]
    assert peak_rss_kb(server.proc.pid) - before < LIMIT_KB


def test_3_valid_requests_unchanged(server):
    r = httpx.post(server.url + "/embed", json={"inputs": ["a", "b"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 2
    r = httpx.post(server.url + "/embed", json={"inputs": ["a", 3]}, timeout=60)
    assert r.status_code == 422 and "invalid field 'inputs'" in r.text
