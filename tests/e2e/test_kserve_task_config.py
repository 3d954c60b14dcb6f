"""Triton's model configuration of task models (classify, rerank, token-classify) against a real
`surge serve --model-repository`, over HTTP (GET .../config) and gRPC (ModelConfig, with tritonclient):
it must describe the tensors the model takes and gives, the same as its metadata does (a client that
builds its requests from the config must not be sent to the embedding contract)."""

from __future__ import annotations

import httpx
import pytest

tg = pytest.importorskip("tritonclient.grpc")

from surge.models.tensor_config import TRITON_TYPE  # noqa: E402
from tests.e2e.repo_helpers import FAST, add_version  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402
from tests.task_models import task_models_dir  # noqa: E402

TASKS = {"intent": "classify", "ce": "rerank", "slots": "token-classify"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = task_models_dir()
    root = tmp_path_factory.mktemp("taskrepo")
    for name in TASKS:
        add_version(root, name, 1, FAST + f"source: {models / name}\n")
    with ServerProcess("--model-repository", str(root), "--threads", "1", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _tensors(entries) -> list[tuple[str, str, list[int]]]:
    return [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in entries]


def _expected(meta_tensors, batched: bool) -> list[tuple[str, str, list[int]]]:
    """A metadata tensor in the config's terms: Triton's type name, and with max_batch_size > 0 the dims
    without the batch dimension (a per-item scalar is [1])."""
    out = []
    for t in meta_tensors:
        dims = [int(d) for d in t["shape"]][1:] if batched else [int(d) for d in t["shape"]]
        out.append((t["name"], TRITON_TYPE[t["datatype"]], dims or [1]))
    return out


def test_task_model_config_describes_its_own_tensors(server, http):
    g = tg.InferenceServerClient(server.grpc_url)
    try:
        for name, task in TASKS.items():
            meta = http.get(f"/v2/models/{name}").json()
            cfg = http.get(f"/v2/models/{name}/config").json()
            assert cfg["parameters"]["task"]["string_value"] == task
            batched = int(cfg.get("max_batch_size", 0)) > 0
            assert _tensors(cfg["input"]) == _expected(meta["inputs"], batched), (name, cfg["input"])
            assert _tensors(cfg["output"]) == _expected(meta["outputs"], batched), (name, cfg["output"])
            gcfg = g.get_model_config(name, as_json=True)["config"]  # gRPC ModelConfig says the same
            assert [t["name"] for t in gcfg["input"]] == [t["name"] for t in meta["inputs"]], name
            assert [t["name"] for t in gcfg["output"]] == [t["name"] for t in meta["outputs"]], name
            assert [[int(d) for d in t["dims"]] for t in gcfg["output"]] == [d for _, _, d in _tensors(cfg["output"])]
    finally:
        g.close()


def test_task_model_binary_data_flags_must_be_json_booleans(http):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["turn on the lights"]}]}
    for extra, needle in [({"parameters": {"binary_data_output": "false"}}, "binary_data_output"),
                          ({"outputs": [{"name": "logits", "parameters": {"binary_data": "no"}}]}, "binary_data")]:
        r = http.post("/v2/models/intent/infer", json={**body, **extra})
        assert r.status_code == 400 and needle in r.json()["error"], (r.status_code, r.content[:200])
    r = http.post("/v2/models/intent/infer", json={**body, "parameters": {"binary_data_output": False}})
    assert r.status_code == 200 and "data" in r.json()["outputs"][0], r.text
