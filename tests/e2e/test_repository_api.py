"""The model repository over HTTP against a real `surge serve --model-repository`:
list, load, unload, reload, version policies, clear errors for invalid model.yaml,
a failed load that leaves the serving version untouched, and polling."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from tests.conftest import cosine_rows
from tests.e2e.repo_helpers import FAST, add_version, entries, serving, set_shared
from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    add_version(root, "enc", 1)
    add_version(root, "bad", 1, "engine: {threads: -1}\n")
    return root


@pytest.fixture(scope="module")
def client(repo):
    with ServerProcess("--model-repository", str(repo), "--threads", "1") as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


def embed(client, version=None, text="turn on the kitchen lights"):
    body = {"inputs": [text], "model": "enc"}
    if version:
        body["version"] = version
    return client.post("/embed", json=body)


def test_index_lists_models_and_explains_invalid_yaml(client, repo):
    models = client.get("/models").json()["models"]
    by_name = {(m["name"], m["version"]): m for m in models}
    assert by_name[("enc", "1")]["state"] == "READY" and by_name[("enc", "1")]["serving"]
    bad = by_name[("bad", "1")]
    assert bad["state"] == "UNAVAILABLE" and not bad["serving"]
    # Files are named relative to the repository (issue 16: no absolute server paths in answers).
    assert bad["reason"].startswith("bad/1/model.yaml") and "engine.threads" in bad["reason"], bad
    assert str(repo) not in bad["reason"]
    r = client.post("/models/bad/load")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_config" and "bad/1/model.yaml" in err["message"]
    assert "engine.threads" in err["message"]
    assert client.get("/ready").status_code == 200  # one broken model does not make the server unready


def test_embed_from_repository_matches_reference(client, reference_embed, sentences):
    r = client.post("/embed", json={"inputs": sentences[:4], "model": "enc"})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "1" and r.headers["x-surge-model-version"] == "1"
    got = np.array(r.json()["embeddings"], dtype=np.float32)
    assert cosine_rows(got, reference_embed(sentences[:4])).min() >= 0.99999


def test_unknown_model_and_version_are_404(client):
    for path in ("/models/nope/load", "/models/nope/unload", "/models/nope/reload"):
        r = client.post(path)
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"], r.text
    r = client.post("/models/enc/load", json={"version": "9"})
    assert r.status_code == 404 and "version '9'" in r.json()["error"]["message"]
    r = client.post("/models/enc/load", json={"version": "x1"})
    assert r.status_code == 400 and "positive integer" in r.json()["error"]["message"]
    r = client.post("/models/enc/load", json={"versoin": "1"})
    assert r.status_code == 422 and "versoin" in r.json()["error"]["message"]
    assert client.get("/models/nope").status_code == 404


def test_unload_then_load(client):
    r = client.post("/models/enc/unload")
    assert r.status_code == 200, r.text
    assert r.json()["versions"][0]["state"] == "UNAVAILABLE"
    r = embed(client)
    assert r.status_code == 404 and "enc" in r.json()["error"]["message"]
    assert client.post("/models/enc/unload").status_code == 404  # not loaded any more
    r = client.post("/models/enc/load")
    assert r.status_code == 200 and r.json()["versions"][0]["state"] == "READY", r.text
    assert embed(client).json()["version"] == "1"


def test_version_policies(client, repo):
    add_version(repo, "enc", 2)
    # Default policy, latest 1: version 2 comes in, version 1 goes.
    assert client.post("/models/enc/load").status_code == 200
    assert serving(client, "enc") == ["2"] and entries(client, "enc")["1"]["state"] == "UNAVAILABLE"
    assert embed(client).json()["version"] == "2"
    assert embed(client, version="1").status_code == 404
    # latest 2: both served, the newest by default, the older one when asked for.
    set_shared(repo, "enc", "version_policy: {latest: 2}\n")
    assert client.post("/models/enc/load").status_code == 200
    assert serving(client, "enc") == ["1", "2"]
    assert embed(client).json()["version"] == "2" and embed(client, version="1").json()["version"] == "1"
    # specific: exactly version 1.
    set_shared(repo, "enc", "version_policy: {specific: ['1']}\n")
    assert client.post("/models/enc/load").status_code == 200
    assert serving(client, "enc") == ["1"] and embed(client).json()["version"] == "1"
    # Unload one version explicitly, load one explicitly.
    set_shared(repo, "enc", "version_policy: {latest: 1}\n")
    assert client.post("/models/enc/load", json={"version": 2}).status_code == 200
    assert serving(client, "enc") == ["1", "2"]
    assert client.post("/models/enc/unload?version=1").status_code == 200
    assert serving(client, "enc") == ["2"]


def test_reload_swaps_in_a_new_build(client, repo):
    before = embed(client).json()
    add_version(repo, "enc", 2, "engine: {threads: 1, warmup_shapes: [[1, 8]], max_seq_len: 6}\n")
    r = client.post("/models/enc/reload")
    assert r.status_code == 200, r.text
    long_text = "please turn on all of the lights in the kitchen and the living room"
    after = embed(client, text=long_text).json()
    assert after["version"] == "2" and before["version"] == "2"
    # max_seq_len 6 now truncates: the reloaded build really is the new configuration.
    r = client.post("/embed", json={"inputs": [long_text], "model": "enc", "truncate": False})
    assert r.status_code == 413 and "6" in r.json()["error"]["message"], r.text
    add_version(repo, "enc", 2)
    assert client.post("/models/enc/reload").status_code == 200
    assert client.post("/embed", json={"inputs": [long_text], "model": "enc", "truncate": False}).status_code == 200


def test_failed_load_leaves_serving_version_untouched(client, repo):
    empty = repo / "empty-artifact"
    empty.mkdir(exist_ok=True)
    add_version(repo, "enc", 3, f"artifact: {empty}\n" + FAST)
    r = client.post("/models/enc/load")
    assert r.status_code == 500, r.text
    msg = r.json()["error"]["message"]
    assert "version 3 failed to load" in msg and "version 2 keeps serving" in msg, msg
    e = entries(client, "enc")
    assert e["3"]["state"] == "UNAVAILABLE" and "load failed" in e["3"]["reason"]
    assert serving(client, "enc") == ["2"] and embed(client).json()["version"] == "2"
    (repo / "enc" / "3" / "model.yaml").unlink()
    (repo / "enc" / "3").rmdir()


def test_polling_notices_a_new_version(tmp_path):
    add_version(tmp_path, "enc", 1)
    with ServerProcess("--model-repository", str(tmp_path), "--repository-poll-s", "0.3") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        assert serving(c, "enc") == ["1"]
        add_version(tmp_path, "enc", 2)
        deadline = time.monotonic() + 60
        while serving(c, "enc") != ["2"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert serving(c, "enc") == ["2"]
        assert c.post("/embed", json={"inputs": "hi", "model": "enc"}).json()["version"] == "2"


def test_without_repository_the_single_model_is_listed_and_reloads():
    with ServerProcess("--threads", "1") as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        models = c.get("/models").json()["models"]
        assert [(m["name"], m["version"], m["state"]) for m in models] == [("all-MiniLM-L6-v2", "1", "READY")]
        before = c.post("/embed", json={"inputs": "set a timer for ten minutes"}).json()["embeddings"]
        r = c.post("/models/all-MiniLM-L6-v2/reload")
        assert r.status_code == 200, r.text
        after = c.post("/embed", json={"inputs": "set a timer for ten minutes"})
        assert after.status_code == 200 and after.json()["embeddings"] == before
        assert c.post("/models/unknown-model/reload").status_code == 404


def test_source_path_relative_to_the_yaml(client, repo, reference_embed):
    from surge.models import bundled_model_dir

    weights = repo.parent / f"{repo.name}-weights"  # outside the repository: not a model
    weights.mkdir(exist_ok=True)
    link = weights / "minilm"
    if not link.exists():
        link.symlink_to(bundled_model_dir(), target_is_directory=True)
    add_version(repo, "local", 1, f"source: ../../../{weights.name}/minilm\n" + FAST)
    r = client.post("/models/local/load")
    assert r.status_code == 200, r.text
    text = "a model directory named by a path relative to model.yaml"
    body = client.post("/embed", json={"inputs": [text], "model": "local"}).json()
    assert body["model"] == "local" and body["version"] == "1"
    assert cosine_rows(np.array(body["embeddings"]), reference_embed([text]))[0] >= 0.99999
    assert client.post("/models/local/unload").status_code == 200
