"""What an audit of the running server found (issue 16), each against a real
`surge serve --model-repository` process with real HTTP and gRPC clients:

- lifecycle names cannot leave the repository (traversal, absolute paths,
  aliases of one model, symlinks out of the root), over HTTP and gRPC;
- token ids >= 2^63, negative or >= the vocabulary are a 400 on every route
  that takes ids, and the keep-alive connection survives;
- gRPC RepositoryIndex works in repository mode;
- 405 keeps `Allow`; JSON routes want a JSON content type (415); KServe infer
  takes JSON and the binary tensor types tritonclient sends;
- errors echo bounded names and repository-relative paths.
"""

from __future__ import annotations

import http.client
import os
import struct

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from tests.e2e.repo_helpers import FAST, add_version
from tests.server_process import ServerProcess

VOCAB = 30522  # all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    base = tmp_path_factory.mktemp("hardening")
    repo, outside = base / "repo", base / "outside"
    add_version(repo, "enc", 1)
    add_version(outside, "evil", 1)  # a valid model, but not in the repository
    # Ways out of the root that the directory listing itself offers: a model
    # directory and a version directory that are symlinks, an artifact path, a pipeline.
    (repo / "sneaky").symlink_to(outside / "evil", target_is_directory=True)
    (repo / "linked").mkdir()
    (repo / "linked" / "1").symlink_to(outside / "evil" / "1", target_is_directory=True)
    add_version(repo, "art", 1, f"artifact: ../../../outside/evil/1\n" + FAST)
    (outside / "pipe").mkdir()
    (outside / "pipe" / "pipeline.yaml").write_text("nodes: []\n")
    (repo / "pipe").symlink_to(outside / "pipe", target_is_directory=True)
    return base, repo, outside


@pytest.fixture(scope="module")
def server(layout):
    _, repo, _ = layout
    with ServerProcess("--model-repository", str(repo), "--threads", "1", "--allow-token-ids", grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def raw_post(server, path: str, body: bytes = b"", headers: dict | None = None, conn=None):
    """A request sent as written (no path normalisation: curl --path-as-is)."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        if own:
            conn.close()


def served_names(client) -> set[str]:
    return {m["id"] for m in client.get("/v1/models").json()["data"]}


TRAVERSAL = ["..", ".", "../outside/evil", "../../../../etc", "enc/.", "enc//", "./enc", "enc/../enc",
             "/etc", "sneaky", "linked", "art", "pipe", "", "enc\x00"]


def test_only_listed_names_load_over_grpc(stub, client, layout):
    base, repo, outside = layout
    names = [*TRAVERSAL, str(outside / "evil"), str(repo / "enc"), f"{repo}/../outside/evil"]
    for name in names:
        with pytest.raises(grpc.RpcError) as err:
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name), timeout=120)
        assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), (name, err.value)
        if str(base) not in name:  # only the name it was given, never where the repository lies
            assert str(base) not in err.value.details(), err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=name), timeout=120)
        assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), (name, err.value)
    assert served_names(client) == {"enc"}  # no copy, no alias, nothing from outside


def test_only_listed_names_load_over_http(server, client, layout):
    base, _, _ = layout
    for name in ["..", ".", "%2E%2E", "%2e", "sneaky", "linked", "art", "pipe"]:
        for path in (f"/models/{name}/load", f"/models/{name}/reload", f"/models/{name}/unload",
                     f"/v2/repository/models/{name}/load", f"/v2/repository/models/{name}/unload"):
            status, _, body = raw_post(server, path)
            # linked/art are listed, but their one version points outside: 400 (invalid), not loaded.
            assert status == (400 if name in ("linked", "art") and "unload" not in path else 404), (path, status, body)
            assert str(base).encode() not in body, body
    for path in ("/models/enc/./load", "/models/../models/enc/load", "/models//load", "/v2/repository/models/../load"):
        status, _, body = raw_post(server, path)
        assert status == 404, (path, status, body)
    assert served_names(client) == {"enc"}
    # The one listed name still loads.
    assert client.post("/models/enc/load").status_code == 200


def test_the_index_lists_only_what_lies_inside(client):
    listing = {(m["name"], m["version"]): m for m in client.get("/models").json()["models"]}
    assert "sneaky" not in {n for n, _ in listing} and "pipe" not in {n for n, _ in listing}
    linked = [m for (n, _), m in listing.items() if n == "linked"]
    assert linked and all(m["state"] == "UNAVAILABLE" and "outside the repository" in m["reason"] for m in linked)
    art = listing[("art", "1")]
    assert art["state"] == "UNAVAILABLE" and "outside the repository" in art["reason"], art
    pipes = client.get("/pipelines").json()
    assert "pipe" not in pipes["errors"] and not pipes["pipelines"], pipes


def test_grpc_repository_index_in_repository_mode(stub, server):
    index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=60)
    got = {(m.name, m.version): m.state for m in index.models}
    assert got[("enc", "1")] == "READY"
    ready = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), timeout=60)
    assert {(m.name, m.version) for m in ready.models} == {("enc", "1")}
    g = tgrpc.InferenceServerClient(server.grpc_url)
    try:
        models = g.get_model_repository_index(as_json=True)["models"]
        assert {"name": "enc", "version": "1", "state": "READY"} in models, models
    finally:
        g.close()
    h = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        for entry in h.get_model_repository_index():
            assert set(entry) <= {"name", "version", "state", "reason"}, entry
    finally:
        h.close()


BAD_IDS = [2 ** 63, 2 ** 64 - 1, -1, -(2 ** 63), VOCAB, 2 ** 64, 10 ** 30]


def test_out_of_range_token_ids_are_400_and_keep_the_connection(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        for bad in BAD_IDS:
            for path, key in (("/v1/embeddings", "input"), ("/embed", "inputs")):
                for payload in ([101, bad, 102], [[101, 102], [101, bad]]):
                    body = b'{"%s": %s, "model": "enc"}' % (key.encode(), str(payload).encode())
                    status, headers, text = raw_post(server, path, body, conn=conn)
                    # Past 64 bits the JSON parser reads a float: not an integer list (422).
                    assert status == 400 or (status == 422 and bad >= 2 ** 64), (path, bad, status, text)
                    assert headers.get("connection", "").lower() != "close"
            body = b'{"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [101, %d, 102]}]}' % bad
            status, _, text = raw_post(server, "/v2/models/enc/infer", body, conn=conn)
            assert status == 400, (bad, status, text)
        # The same connection still answers a good request.
        status, _, text = raw_post(server, "/embed", b'{"inputs": [[101, 7592, 102]], "model": "enc"}', conn=conn)
        assert status == 200, text
    finally:
        conn.close()


def test_out_of_range_token_ids_over_grpc(stub):
    for bad in (-1, -(2 ** 63), VOCAB, 2 ** 63 - 1):
        req = pb.ModelInferRequest(model_name="enc")
        t = req.inputs.add(name="input_ids", datatype="INT64", shape=[1, 3])
        t.contents.int64_contents.extend([101, bad, 102])
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    for raw in (struct.pack("<3Q", 101, 2 ** 63, 102), struct.pack("<3Q", 101, 2 ** 64 - 1, 102)):
        for datatype in ("INT64", "UINT64"):
            req = pb.ModelInferRequest(model_name="enc", raw_input_contents=[raw])
            req.inputs.add(name="input_ids", datatype=datatype, shape=[1, 3])
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(req, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value


def test_405_keeps_allow(client):
    for method, path in (("GET", "/embed"), ("DELETE", "/v1/embeddings"), ("PUT", "/models/enc/load"),
                         ("GET", "/v2/models/enc/infer"), ("POST", "/health")):
        r = client.request(method, path)
        assert r.status_code == 405, (method, path, r.status_code)
        assert r.headers.get("allow"), (method, path, r.headers)
        assert method not in r.headers["allow"]
    # Every route of the path counts (GET and POST /pipelines/{name} are two routes).
    r = client.request("PUT", "/pipelines/x")
    assert r.status_code == 405 and {"GET", "POST"} <= set(r.headers["allow"].replace(" ", "").split(","))


def test_openapi_declares_bodies_and_errors(client):
    doc = client.get("/openapi.json").json()
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert len(posts) >= 11
    for path, op in posts.items():
        assert "requestBody" in op, path
        content = op["requestBody"]["content"]
        assert "application/json" in content, path
        errors = {code for code in op["responses"] if code.startswith(("4", "5"))}
        assert {"400", "404", "415"} <= errors or {"400", "415"} <= errors, (path, sorted(op["responses"]))
    infer = posts["/v2/models/{name}/infer"]["requestBody"]["content"]
    assert "application/octet-stream" in infer


def test_json_routes_want_a_json_content_type(server, client):
    ok_json = b'{"inputs": ["hello"], "model": "enc"}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx.post(server.url + "/embed", content=ok_json, headers=headers, timeout=60)
        assert r.status_code == 415, (ctype, r.status_code, r.text)
        r = httpx.post(server.url + "/models/enc/unload", content=b"{}", headers=headers, timeout=60)
        assert r.status_code == 415, (ctype, r.status_code, r.text)
        r = httpx.post(server.url + "/v1/embeddings", content=b'{"input": "hi", "model": "enc"}',
                       headers=headers, timeout=60)
        assert r.status_code == 415, (ctype, r.status_code, r.text)
    assert served_names(client) == {"enc"}  # the refused unload did nothing
    for ctype in ("application/json", "application/json; charset=utf-8", "APPLICATION/JSON"):
        r = httpx.post(server.url + "/embed", content=ok_json, headers={"Content-Type": ctype}, timeout=60)
        assert r.status_code == 200, (ctype, r.text)
    # Body-less lifecycle calls need no content type (curl -XPOST .../load)...
    r = httpx.post(server.url + "/models/enc/load", timeout=120)
    assert r.status_code == 200, r.text
    # ...unless a browser sends them from another origin (no preflight would stop it).
    for hdrs in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        for path in ("/models/enc/unload", "/v2/repository/models/enc/unload"):
            r = httpx.post(server.url + path, headers=hdrs, timeout=60)
            assert r.status_code == 415, (path, hdrs, r.text)
    assert served_names(client) == {"enc"}
    r = httpx.post(server.url + "/models/enc/load", timeout=120,
                   headers={"Origin": server.url, "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200, r.text


def test_kserve_infer_takes_the_types_tritonclient_sends(server, client):
    text = "kserve content types"
    want = np.asarray(client.post("/embed", json={"inputs": [text], "model": "enc"}).json()["embeddings"])
    h = thttp.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        for binary in (True, False):
            inp = thttp.InferInput("text", [1], "BYTES")
            inp.set_data_from_numpy(np.array([text.encode()], dtype=object), binary_data=binary)
            out = thttp.InferRequestedOutput("embedding", binary_data=binary)
            got = h.infer("enc", [inp], outputs=[out]).as_numpy("embedding")
            np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        h.close()
    head = b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"parameters":{"binary_data_size":%d}}]}'
    raw = struct.pack("<I", len(text)) + text.encode()
    head = head % len(raw)
    for ctype in ("application/octet-stream", "application/vnd.sagemaker-triton.binary+json;json-header-size=%d"
                  % len(head)):
        r = httpx.post(server.url + "/v2/models/enc/infer", content=head + raw, timeout=60,
                       headers={"Content-Type": ctype, "Inference-Header-Content-Length": str(len(head))})
        assert r.status_code == 200, (ctype, r.text)
    r = httpx.post(server.url + "/v2/models/enc/infer", content=head + raw, timeout=60,
                   headers={"Content-Type": "text/plain", "Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 415, r.text


def test_errors_echo_bounded_names_and_relative_paths(server, client, stub, layout):
    base, repo, _ = layout
    long = "x" * 100_000
    r = client.post("/embed", json={"inputs": ["hi"], "model": long})
    assert r.status_code == 404 and len(r.content) < 1000, len(r.content)
    assert "x" * 64 in r.text and "\u2026" in r.json()["error"]["message"]
    r = client.post("/v2/models/enc/infer", json={"inputs": [{"name": long, "datatype": "BYTES", "shape": [1],
                                                             "data": ["a"]}]})
    assert r.status_code == 400 and len(r.content) < 1000, len(r.content)
    r = client.post("/embed", json={"inputs": ["hi"], long: 1})
    assert r.status_code == 422 and len(r.content) < 1000, len(r.content)
    status, _, body = raw_post(server, f"/models/{'y' * 8000}/load")
    assert status == 404 and len(body) < 1000, len(body)
    with pytest.raises(grpc.RpcError) as err:
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=long), timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and len(err.value.details()) < 1000
    req = pb.ModelInferRequest(model_name=long)
    req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a")
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and len(err.value.details()) < 1000
    # Repository errors name files relative to the repository root.
    add_version(repo, "broken", 1, "engine: {threads: -1}\n")
    try:
        r = client.post("/models/broken/load")
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "broken/1/model.yaml" in msg and str(base) not in msg, msg
        reasons = [m["reason"] for m in client.get("/models").json()["models"]]
        assert reasons and not any(str(base) in why for why in reasons), reasons
        with pytest.raises(InferenceServerException) as err:
            tgrpc.InferenceServerClient(server.grpc_url).load_model("broken")
        assert str(base) not in str(err.value)
    finally:
        (repo / "broken" / "1" / "model.yaml").unlink()
        os.rmdir(repo / "broken" / "1")
        os.rmdir(repo / "broken")
