"""Small requests that must not make the server do (or hold) far more than the input limits allow,
against a real `surge serve --model-repository` with real HTTP and gRPC clients:

- a rerank query is a text like any other: longer than --max-input-chars it is refused, a 413 on
  Cohere's /v1/rerank as on KServe, and on TEI's /rerank and HF Inference's POST /models/{name} TEI's
  own answer to an input too long, a 422 Validation error (TEI v1.9) (the query is paired with every document, so an
  unchecked 2 MB query against 2048 one-letter documents made 4 GB of cache keys and tokenizer work);
- KServe `input_ids` rows count against --max-inputs before any per-row work: a ~150-byte request
  with shape [10**9, 0] (no data needed, zero elements) built a billion Python lists and the kernel
  killed the server for its memory. Measured here with a smaller shape on the server's peak RSS
  (VmHWM), which is deterministic where a timing would not be.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from tests.e2e.repo_helpers import FAST, add_version
from tests.server_process import ServerProcess
from tests.task_models import task_models_dir

MAX_CHARS = 200
MAX_INPUTS = 16
ROWS = 10_000_000  # empty rows: before the fix ~0.6 GB of lists in the server; after it, nothing


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("amplification")
    add_version(root, "enc", 1)
    add_version(root, "ce", 1, FAST + f"source: {task_models_dir() / 'ce'}\n")
    with ServerProcess("--model-repository", str(root), "--threads", "1", "--max-input-chars", str(MAX_CHARS),
                       "--max-inputs", str(MAX_INPUTS), grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _body(docs_field: str, query: str) -> dict:
    if docs_field == "sentences":  # HF Inference's sentence similarity: the source is paired with every sentence
        return {"inputs": {"source_sentence": query, "sentences": ["a", "b"]}}
    return {"model": "ce", "query": query, docs_field: ["a", "b"]}


@pytest.mark.parametrize("path,docs_field,field", [
    ("/rerank", "texts", "query"), ("/rerank", "documents", "query"), ("/v1/rerank", "documents", "query"),
    ("/v2/rerank", "documents", "query"), ("/models/ce", "sentences", "source_sentence")])
def test_a_rerank_query_longer_than_the_limit_is_refused(client, path, docs_field, field):
    query = "where are the lights " * 20  # 420 characters, over MAX_CHARS
    r = client.post(path, json=_body(docs_field, query))
    tei = path in ("/rerank", "/models/ce")
    assert r.status_code == (422 if tei else 413), r.text
    err = r.json()["error"]  # /v2/rerank (Cohere's v2 path, not KServe's) errs in OpenAI's shape as /v1/rerank
    if tei:  # TEI's shape: {"error": message, "error_type": "Validation"}
        assert r.json()["error_type"] == "Validation"
        err = {"param": field, "message": err}
    assert err["param"] == field and f"'{field}'" in err["message"] and str(MAX_CHARS) in err["message"], err
    ok = client.post(path, json=_body(docs_field, query[:MAX_CHARS]))
    assert ok.status_code == 200, ok.text


def _peak_rss(server) -> int:
    """The server process's peak resident memory in bytes (Linux's VmHWM)."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def fresh(tmp_path):
    """A server of its own per test: memory an earlier request freed but the process kept would hide this
    request's growth."""
    add_version(tmp_path, "enc", 1)
    with ServerProcess("--model-repository", str(tmp_path), "--threads", "1", "--max-inputs", str(MAX_INPUTS),
                       grpc=True) as srv:
        yield srv


def _infer_http(srv, shape) -> tuple[int, str]:
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": shape,
                        "data": [101] * (shape[0] * shape[1])}]}
    r = httpx.post(srv.url + "/v2/models/enc/infer", json=body, timeout=120)
    return r.status_code, r.text


def _infer_grpc(srv, shape) -> tuple[int, str]:
    req = pb.ModelInferRequest(model_name="enc")
    t = req.inputs.add()
    t.name, t.datatype = "input_ids", "INT64"
    t.shape.extend(shape)
    req.raw_input_contents.append((101).to_bytes(8, "little") * (shape[0] * shape[1]))
    with grpc.insecure_channel(srv.grpc_url) as channel:
        try:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=120)
        except grpc.RpcError as err:
            return {grpc.StatusCode.RESOURCE_EXHAUSTED: 413}.get(err.code(), 0), err.details()
    return 200, ""


@pytest.mark.parametrize("infer", [_infer_http, _infer_grpc], ids=["http", "grpc"])
def test_kserve_input_ids_rows_are_limited_before_any_work(fresh, infer):
    # "5" resets the peak to the current RSS (Linux >= 4.0): the growth measured is this request's.
    Path(f"/proc/{fresh.proc.pid}/clear_refs").write_text("5")
    before = _peak_rss(fresh)
    status, text = infer(fresh, [ROWS, 0])  # zero elements: a request of ~100 bytes
    grown = _peak_rss(fresh) - before
    assert status == 413 and "input_ids" in text, text
    assert grown < 150 * 2**20, f"the server's peak memory grew by {grown >> 20} MiB for one ~100-byte request"
    assert infer(fresh, [1, 3])[0] == 200
