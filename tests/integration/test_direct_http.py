"""server/http/direct.py: plain embedding requests answered at the protocol, checked over real TCP
against a real uvicorn server running the real app with the bundled model (in this process, so that
a spy can count which path answered; the spied methods still run).

- a plain request takes the direct path, and its answer equals the ASGI path's bytes for the same
  input and the transformers reference;
- a body the hot path would not answer (options, invalid JSON, unknown model) is handed back and
  the routes answer it exactly as they answer it on the ASGI path;
- requests the direct path must not take (Expect, chunked, other paths, an API key) never reach it
  and are answered as before;
- pipelined requests on one connection are answered in order, each with its own input's vector;
- Connection: close and HTTP/1.0 close the connection after the answer;
- a client that disconnects while its request waits has its inputs dropped, not computed.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import uuid

import numpy as np
import pytest

from surge.server.http import direct as direct_mod
from surge.server.http import frontend

pytestmark = pytest.mark.timeout(300)


class Spy:
    def __init__(self, monkeypatch):
        self.answered = 0
        self.handed_back = 0
        answer, hand_back = direct_mod.DirectRoutes.answer, frontend.CorkedHttpToolsProtocol.hand_back

        def counting_answer(this, *a):
            self.answered += 1
            return answer(this, *a)

        def counting_hand_back(this, *a):
            self.handed_back += 1
            return hand_back(this, *a)

        monkeypatch.setattr(direct_mod.DirectRoutes, "answer", counting_answer)
        monkeypatch.setattr(frontend.CorkedHttpToolsProtocol, "hand_back", counting_hand_back)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """`surge serve`'s own stack (FrontDoor, CorkedHttpToolsProtocol) under uvicorn, in a thread."""

    def __init__(self, keep_alive_s: float = 5, **config):
        import uvicorn

        from surge.cli.bootstrap import build_state
        from surge.config import ServerConfig
        from surge.server.app import create_app

        self.port = _free_port()
        cfg = ServerConfig(port=self.port, log_level="warning", **{"grpc_port": None, **config})
        self.state = build_state(cfg)
        app = frontend.FrontDoor(create_app(self.state))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, http=frontend.CorkedHttpToolsProtocol,
                                                    timeout_keep_alive=keep_alive_s))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        # Earlier tests' garbage (tritonclient's gevent-bound clients) is collected here, on the main
        # thread: collected by the server's thread, its finalizers raise (PytestUnraisableExceptionWarning).
        gc.collect()
        self.thread.start()
        end = time.monotonic() + 180
        while not (self.server.started and self.state.ready):
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(60)


def _request(body, path="/v1/embeddings", headers=b"", version=b"1.1") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (b"POST " + path.encode() + b" HTTP/" + version + b"\r\nHost: t\r\nContent-Type: application/json\r\n"
            + headers + b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def _read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict, bytes]:
    """One response off `sock` (Content-Length framed); what follows it stays in `buf`."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response")
        buf += chunk
    head, _, _ = bytes(buf).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode()
    start = len(head) + 4
    end = start + (0 if status < 200 else int(headers["content-length"]))  # 1xx: no body
    while len(buf) < end:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside a body")
        buf += chunk
    body = bytes(buf[start:end])
    del buf[:end]
    return status, headers, body


def exchange(port: int, *requests: bytes, together: bool = False) -> list[tuple[int, dict, bytes]]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        buf = bytearray()
        if together:  # pipelined: every request in one write
            sock.sendall(b"".join(requests))
            return [_read_response(sock, buf) for _ in requests]
        out = []
        for r in requests:
            sock.sendall(r)
            out.append(_read_response(sock, buf))
        return out


def _vector(body: bytes) -> np.ndarray:
    return np.asarray(json.loads(body)["data"][0]["embedding"], dtype=np.float64)


@pytest.fixture(scope="module")
def server():
    with InProcessServer(cache={"enabled": False}) as srv:
        yield srv


def _unique(sentences, i=0) -> str:
    return f"{sentences[i % len(sentences)]} {uuid.uuid4().hex[:6]}"


def test_a_plain_request_takes_the_direct_path_and_answers_the_asgi_paths_bytes(server, sentences,
                                                                                  reference_embed, monkeypatch):
    spy = Spy(monkeypatch)
    text = _unique(sentences)
    [(status, headers, body)] = exchange(server.port, _request({"input": text}))
    assert status == 200 and spy.answered == 1 and spy.handed_back == 0
    # A query string keeps the request off the direct path (its URL is not exactly the route's):
    # the ASGI hot path answers the same input.
    [(status2, headers2, body2)] = exchange(server.port, _request({"input": text}, path="/v1/embeddings?via=asgi"))
    assert status2 == 200 and spy.answered == 1
    timing = {h for h in headers | headers2 if h.endswith("-ms") or h == "date"}
    assert {k: v for k, v in headers.items() if k not in timing} == {k: v for k, v in headers2.items()
                                                                     if k not in timing}
    assert json.loads(body)["usage"] == json.loads(body2)["usage"]
    v, v2 = _vector(body), _vector(body2)
    assert float(v @ v2 / np.linalg.norm(v) / np.linalg.norm(v2)) > 0.99999
    ref = np.asarray(reference_embed([text])[0], dtype=np.float64)
    assert float(v @ ref / np.linalg.norm(v) / np.linalg.norm(ref)) > 0.999


@pytest.mark.parametrize("body", [
    {"input": "a sentence with options", "dimensions": 8},
    b"{not json",
    {"input": "x", "model": "no-such-model"},
    {"input": ""},
    {"input": ["ok", 3]},
])
def test_a_body_the_hot_path_declines_is_answered_by_the_routes_as_on_the_asgi_path(server, body, monkeypatch):
    spy = Spy(monkeypatch)
    [(status, headers, got)] = exchange(server.port, _request(body))
    assert spy.answered == 1 and spy.handed_back == 1
    [(status2, _, got2)] = exchange(server.port, _request(body, path="/v1/embeddings?via=asgi"))
    assert spy.answered == 1  # the query string kept it off the direct path
    assert status == status2
    if status == 200:  # the options request: computed twice, the same shape and usage
        a, b = json.loads(got), json.loads(got2)
        assert len(a["data"][0]["embedding"]) == len(b["data"][0]["embedding"]) == 8
        assert a["usage"] == b["usage"]
    else:
        assert got == got2 and status in (400, 404, 422)


def test_an_error_raised_while_a_taken_request_computes_is_the_asgi_paths_answer(server, sentences, monkeypatch):
    # Longer than the model takes (OpenAI does not truncate): the direct path takes it (nothing in the
    # body says so), the check after the run raises, and the answer must be the route's 400 byte for byte.
    text = " ".join(_unique(sentences, i) for i in range(40))
    spy = Spy(monkeypatch)
    [(status, _, got)] = exchange(server.port, _request({"input": ["fine", text]}))
    assert spy.answered == 1 and spy.handed_back == 0
    [(status2, _, got2)] = exchange(server.port, _request({"input": ["fine", text]}, path="/v1/embeddings?via=asgi"))
    assert status == status2 == 400 and got == got2
    assert json.loads(got)["error"]["param"] == "input" and "input 1 has" in json.loads(got)["error"]["message"]


@pytest.mark.parametrize("extra,want", [(b"Expect: 100-continue\r\n", 200), (b"Content-Encoding: identity\r\n", 200)])
def test_requests_the_direct_path_must_not_take_never_reach_it(server, sentences, extra, want, monkeypatch):
    spy = Spy(monkeypatch)
    text = _unique(sentences, 3)
    request = _request({"input": text}, headers=extra)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(request)
        buf = bytearray()
        status, _, body = _read_response(sock, buf)
        if status == 100:  # uvicorn's interim answer to Expect
            status, _, body = _read_response(sock, buf)
    assert spy.answered == 0
    assert status == want and len(_vector(body)) == 384


def test_pipelined_requests_are_answered_in_order_each_with_its_own_vector(server, sentences, monkeypatch):
    spy = Spy(monkeypatch)
    texts = [_unique(sentences, i) for i in range(4)]
    alone = [_vector(b) for _, _, b in exchange(server.port, *(_request({"input": t}) for t in texts))]
    reqs = [_request({"input": t}) for t in texts]
    reqs.insert(2, _request({"input": texts[0], "dimensions": 16}))  # a handed-back one among them
    answers = exchange(server.port, *reqs, together=True)
    assert [s for s, _, _ in answers] == [200] * 5
    got = [_vector(b) for _, _, b in answers]
    assert len(got[2]) == 16
    del got[2]
    for a, g in zip(alone, got):
        assert float(a @ g / np.linalg.norm(a) / np.linalg.norm(g)) > 0.99999
    # The four alone and the first pipelined one came through the direct path; the others waited
    # in uvicorn's pipeline (its ASGI path) behind it.
    assert spy.answered >= 5


@pytest.mark.parametrize("headers,version", [(b"Connection: close\r\n", b"1.1"), (b"", b"1.0")])
def test_a_connection_not_kept_alive_is_closed_after_its_answer(server, sentences, headers, version, monkeypatch):
    spy = Spy(monkeypatch)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(_request({"input": _unique(sentences, 5)}, headers=headers, version=version))
        buf = bytearray()
        status, got_headers, body = _read_response(sock, buf)
        assert status == 200 and len(_vector(body)) == 384
        assert got_headers.get("connection") == "close"
        assert sock.recv(1024) == b""  # closed by the server
    assert spy.answered == 1


def test_an_api_key_keeps_every_request_on_the_asgi_path(sentences, monkeypatch):
    spy = Spy(monkeypatch)
    with InProcessServer(api_key="k3y", cache={"enabled": False}) as srv:
        [(status, _, _)] = exchange(srv.port, _request({"input": "no key"}))
        [(status2, _, body)] = exchange(srv.port, _request({"input": _unique(sentences)},
                                                           headers=b"Authorization: Bearer k3y\r\n"))
    assert status == 401 and status2 == 200 and len(_vector(body)) == 384
    assert spy.answered == 0


def test_a_client_that_disconnects_has_its_inputs_dropped(sentences, monkeypatch):
    from surge.runtime.slowdown import ENV

    monkeypatch.setenv(ENV, "4000")  # every batch takes 4 s more: the second batch is still queued
    from tests.e2e.test_runtime_serving import metrics

    with InProcessServer(cache={"enabled": False}, batching={"max_batch_size": 1}, engine={"instances": 1}) as srv:
        spy = Spy(monkeypatch)
        url = f"http://127.0.0.1:{srv.port}"
        before = metrics(url)
        socks = []
        for i in range(4):  # one batch runs, three inputs wait behind it
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
            s.sendall(_request({"input": _unique(sentences, i)}))
            socks.append(s)
        end = time.monotonic() + 60
        while metrics(url).get(("surge_inflight_inputs", ()), 0) < 4:  # all four admitted, whatever the speed
            assert time.monotonic() < end, "the four requests were not admitted"
            time.sleep(0.05)
        for s in socks[1:]:
            s.close()
        with socks[0] as s:
            status, _, _ = _read_response(s, bytearray())
        assert status == 200
        end = time.monotonic() + 30
        key = ("surge_inputs_dropped_total", (("reason", "cancelled"),))
        while True:
            after = metrics(url)
            dropped = after.get(key, 0) - before.get(key, 0)
            if dropped >= 3 or time.monotonic() > end:
                break
            time.sleep(0.2)
        assert spy.answered == 4
        assert dropped == 3
        assert after[("surge_batch_size_sum", ())] - before[("surge_batch_size_sum", ())] == 1


def test_a_body_that_arrives_in_pieces_is_read_whole(server, sentences, monkeypatch):
    spy = Spy(monkeypatch)
    text = _unique(sentences, 7)
    request = _request({"input": text})
    head, _, body = request.partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + b"\r\n\r\n" + body[:5])
        time.sleep(0.2)  # the protocol has the headers and part of the body
        sock.sendall(body[5:])
        status, _, got = _read_response(sock, bytearray())
    [(_, _, alone)] = exchange(server.port, _request({"input": text}))
    assert status == 200 and spy.answered == 2
    a, b = _vector(got), _vector(alone)
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.99999


@pytest.fixture(scope="module")
def classifier():
    from tests.task_models import task_models_dir

    models = task_models_dir()
    with InProcessServer(model_dir=models / "intent", cache={"enabled": False}) as srv:
        yield srv, models


def test_a_plain_classify_request_takes_the_direct_path_with_the_routes_bytes(classifier, monkeypatch):
    from transformers import pipeline

    from surge.models.finetune import heldout_commands

    srv, models = classifier
    spy = Spy(monkeypatch)
    texts = heldout_commands(3)
    for body in ({"inputs": texts[0]}, {"inputs": texts}):
        [(status, _, got)] = exchange(srv.port, _request(body, path="/predict"))
        [(status2, _, via_asgi)] = exchange(srv.port, _request(body, path="/predict?via=asgi"))
        assert status == status2 == 200 and got == via_asgi
    assert spy.answered == 2 and spy.handed_back == 0
    ref = pipeline("text-classification", model=str(models / "intent"), device="cpu", top_k=None)
    for text, labels in zip(texts, json.loads(got)):
        rows = ref(text)
        rows = rows[0] if rows and isinstance(rows[0], list) else rows  # one text: [[...]] or [...]
        want = {d["label"]: d["score"] for d in rows}
        assert [d["label"] for d in labels] == sorted(want, key=want.get, reverse=True)
        assert max(abs(d["score"] - want[d["label"]]) for d in labels) < 1e-4


@pytest.mark.parametrize("body", [{"inputs": ["a", "b"]}, {"inputs": "x", "raw_scores": True}, {"inputs": ""}])
def test_a_classify_body_the_hot_path_declines_is_answered_by_the_route(classifier, body, monkeypatch):
    srv, _ = classifier
    spy = Spy(monkeypatch)
    [(status, _, got)] = exchange(srv.port, _request(body, path="/predict"))
    [(status2, _, via_asgi)] = exchange(srv.port, _request(body, path="/predict?via=asgi"))
    assert spy.answered == 1 and spy.handed_back == 1
    assert status == status2 and got == via_asgi


def test_a_pipelined_request_behind_a_cache_hit_is_not_cut_off_by_the_keep_alive_timer(sentences, monkeypatch):
    from surge.runtime.slowdown import ENV

    monkeypatch.setenv(ENV, "2500")  # the second request's batch outlasts the 1 s keep-alive timeout
    with InProcessServer(keep_alive_s=1, engine={"instances": 1}) as srv:
        hit, miss = _unique(sentences, 1), _unique(sentences, 2)
        [(status, _, first)] = exchange(srv.port, _request({"input": hit}))  # now in the cache
        spy = Spy(monkeypatch)
        # The hit is answered inside the parser's callback, before the miss behind it is parsed.
        answers = exchange(srv.port, _request({"input": hit}), _request({"input": miss}), together=True)
    assert status == 200 and [s for s, _, _ in answers] == [200, 200]
    assert answers[0][2] == first and len(_vector(answers[1][2])) == 384
    assert spy.answered == 2


def _server_side(srv, client: socket.socket):
    """The server's protocol of `client`'s connection (the in-process server's own object)."""
    here = client.getsockname()
    for proto in list(srv.server.server_state.connections):
        if getattr(proto, "client", None) == here:
            return proto
    return None


def test_pipelined_cache_hits_of_a_client_that_reads_nothing_are_not_buffered_without_bound(sentences,
                                                                                            monkeypatch):
    """A client pipelines many cached requests (small bodies, ~100 KB answers) and reads nothing, as a slow
    reader that the send deadline never cuts may. The direct path answered each one inside the parser's
    callback and kept reading, so every answer waited in the server's memory (the transport's buffer grew by
    n x the answer); the ASGI path waits for the buffer to drain before each answer. Now the server stops
    taking requests once what waits to be sent is past the transport's high-water mark, and answers the rest,
    in order and whole, as the client reads."""
    n = 200
    with InProcessServer() as srv:
        texts = [_unique(sentences, i) for i in range(16)]
        request = _request({"input": texts})
        [(status, _, first)] = exchange(srv.port, request)  # cached from now on
        assert status == 200
        spy = Spy(monkeypatch)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # the kernel holds little for the client
        sock.settimeout(120)
        sock.connect(("127.0.0.1", srv.port))
        with sock:
            sender = threading.Thread(target=sock.sendall, args=(request * n,), daemon=True)
            sender.start()  # its last writes may wait while the server holds off reading
            end = time.monotonic() + 120
            while True:  # every request answered (the old way) or the server waits for the client (the new)
                proto = _server_side(srv, sock)
                if proto is not None and (spy.answered >= n or (proto.flow.read_paused and proto.flow.write_paused)):
                    break
                assert time.monotonic() < end, "the server neither answered every request nor waited for the client"
                time.sleep(0.05)
            buffered = proto.transport.get_write_buffer_size()
            _, high = proto.transport.get_write_buffer_limits()
            assert buffered <= high + 4 * len(first), (buffered, len(first))
            assert spy.answered < n
            buf = bytearray()
            answers = [_read_response(sock, buf) for _ in range(n)]  # then all of them, as the client reads
            sender.join(60)
    assert [s for s, _, _ in answers] == [200] * n
    assert all(body == first for _, _, body in answers)
