"""KServe v2 inference on an embedding model: a large request's tensors are decoded (each value checked and
converted, ~0.25 us a value: 819,200 token ids ~200 ms) on a preparation thread (runtime/off_loop.py), not on
the event loop, over HTTP and gRPC; a small one's stay on the loop. Its answer and its errors are those of the
same request decoded on the loop. The same for /v1/embeddings and /embed with many token ids: a body over
hotpath.HOT_MAX_BYTES skips the plain-request paths (which decode on the loop) and its inputs are checked on a
preparation thread (split_input).

A real uvicorn server running the real app in this process (tests/integration/test_direct_http.py) with a tiny
decoder embedding model; where the values were decoded is read off the thread kserve_contract.from_values ran
on (no timing). gRPC: the servicer's own decode step, called as its ModelInfer calls it.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from surge.runtime import off_loop
from surge.server import kserve_contract
from surge.server.http import hotpath, native, openai
from tests.decoder_models import build_embedding_model
from tests.integration.test_direct_http import InProcessServer

pytestmark = pytest.mark.timeout(600)

IDS = [[(7 * r + c) % 300 + 5 for c in range(40)] for r in range(300)]  # ~40 KB of JSON: over OFF_LOOP_BYTES


def _ids(rows, **extra) -> dict:
    flat = [v for row in rows for v in row]
    return {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [len(rows), len(rows[0])],
                        "data": flat, **extra}]}


CASES = [
    _ids(IDS),
    {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [300], "data": [f"word {i} " * 20 for i in range(300)]}],
     "parameters": {"normalize": False}},
    # bad input: the same errors
    {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [300, 40],
                 "data": [v for row in IDS for v in row][:-1] + ["x"]}]},
    _ids(IDS[:-1] + [[-1] * 40]),
    {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [300, 41], "data": [7] * 12_000}]},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = build_embedding_model("qwen3", tmp_path_factory.mktemp("kserve-offloop") / "e", seed=4)
    with InProcessServer(model_dir=str(d), model_name="e", engine={"threads": 1},
                         limits={"allow_token_ids": True, "auto_truncate": True}) as srv:
        yield srv


@pytest.fixture
def decoded_on(monkeypatch):
    """The names of the threads tensor values were decoded on."""
    names: list[str] = []
    from_values = kserve_contract.from_values

    def spy(*args):
        names.append(threading.current_thread().name)
        return from_values(*args)

    monkeypatch.setattr(kserve_contract, "from_values", spy)
    return names


async def _here(fn, *args):
    return fn(*args)


def _send(srv, body: dict, path: str = "/v2/models/e/infer") -> tuple[int, bytes]:
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=120) as c:
        r = c.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        return r.status_code, r.content


def test_a_large_infer_request_is_decoded_on_a_preparation_thread_and_answered_as_on_the_loop(
        server, monkeypatch, decoded_on):
    threaded = [_send(server, body) for body in CASES]
    assert decoded_on and all(name.startswith("surge-prepare") for name in decoded_on), set(decoded_on)
    decoded_on.clear()
    with monkeypatch.context() as m:
        m.setattr(off_loop, "off_loop", _here)  # everything on the event loop, as before
        inline = [_send(server, body) for body in CASES]
    assert decoded_on and not any(name.startswith("surge-prepare") for name in decoded_on), set(decoded_on)
    for body, a, b in zip(CASES, inline, threaded, strict=True):
        assert a == b, (json.dumps(body)[:100], a[0], b[0], a[1][:300], b[1][:300])
    statuses = [status for status, _ in inline]
    assert statuses[:2] == [200, 200] and all(s == 400 for s in statuses[2:]), [(s, b[:200]) for s, b in inline]
    assert len(json.loads(inline[0][1])["outputs"][0]["data"]) > 300


def test_a_small_infer_request_is_decoded_on_the_loop(server, decoded_on):
    status, _ = _send(server, _ids(IDS[:2]))
    assert status == 200
    assert decoded_on and not any(name.startswith("surge-prepare") for name in decoded_on), set(decoded_on)


def test_grpc_infer_decodes_a_large_request_on_a_preparation_thread(decoded_on):
    from surge.server.grpc import grpc_service_pb2 as pb
    from surge.server.grpc import servicer

    def request(rows):
        req = pb.ModelInferRequest(model_name="e")
        t = req.inputs.add(name="input_ids", datatype="INT64", shape=[len(rows), len(rows[0])])
        t.contents.int64_contents.extend(v for row in rows for v in row)
        return req

    large = asyncio.run(servicer._decoded(request(IDS)))
    assert decoded_on and all(name.startswith("surge-prepare") for name in decoded_on), set(decoded_on)
    decoded_on.clear()
    small = asyncio.run(servicer._decoded(request(IDS[:2])))
    assert decoded_on and not any(name.startswith("surge-prepare") for name in decoded_on), set(decoded_on)
    assert [t.values.tolist() for t in large] == [[v for row in IDS for v in row]]
    assert [t.values.tolist() for t in small] == [[v for row in IDS[:2] for v in row]]


BIG = [[(7 * r + c) % 300 + 5 for c in range(400)] for r in range(200)]  # ~300 KB: over HOT_MAX_BYTES
EMBED_CASES = [
    ("/v1/embeddings", {"model": "e", "input": BIG}),
    ("/embed", {"inputs": BIG}),
    ("/v1/embeddings", {"model": "e", "input": [*BIG, [-1]]}),  # bad input: the same error
    ("/embed", {"inputs": [*BIG, []]}),
]


@pytest.fixture
def split_on(monkeypatch):
    """The names of the threads embedding inputs were checked on (split_input, both routes)."""
    names: list[str] = []
    split = openai.split_input

    def spy(*args):
        names.append(threading.current_thread().name)
        return split(*args)

    monkeypatch.setattr(openai, "split_input", spy)
    monkeypatch.setattr(native, "split_input", spy)
    return names


def test_many_token_ids_for_embeddings_are_checked_on_a_preparation_thread(server, monkeypatch, split_on):
    assert all(len(json.dumps(body)) > hotpath.HOT_MAX_BYTES for _, body in EMBED_CASES)
    threaded = [_send(server, body, path) for path, body in EMBED_CASES]
    assert len(split_on) == len(EMBED_CASES) and all(n.startswith("surge-prepare") for n in split_on), split_on
    split_on.clear()
    with monkeypatch.context() as m:
        m.setattr(off_loop, "off_loop", _here)
        inline = [_send(server, body, path) for path, body in EMBED_CASES]
    assert split_on and not any(n.startswith("surge-prepare") for n in split_on), split_on
    assert [s for s, _ in inline] == [200, 200, 400, 400], [(s, b[:200]) for s, b in inline]
    for (path, _), a, b in zip(EMBED_CASES, inline, threaded, strict=True):
        assert a == b, (path, a[0], b[0], a[1][:300], b[1][:300])
