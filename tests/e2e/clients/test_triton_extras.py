"""tritonclient's extras against a real server: ModelStreamInfer, compressed request
bodies, log and trace settings, shared memory answered as unsupported."""

from __future__ import annotations

import gzip
import queue

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import cosine_rows
from tests.e2e.clients.conftest import API_KEY, AUTH, MODEL

META = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def http_client(main_server):
    c = httpclient.InferenceServerClient(main_server.url.removeprefix("http://"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc_client(main_server):
    c = grpcclient.InferenceServerClient(main_server.grpc_url)
    yield c
    c.close()


def _text(module, texts: list[str]):
    inp = module.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return inp


def test_stream_infer_matches_responses_by_id_with_errors_per_request(grpc_client, reference_embed, sentences):
    got: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: got.put((result, error)), headers=META)
    try:
        batches = {f"req-{i}": sentences[30 + 3 * i: 33 + 3 * i] for i in range(8)}
        for rid, texts in batches.items():
            grpc_client.async_stream_infer(MODEL, [_text(grpcclient, texts)], request_id=rid)
            if rid == "req-3":  # errors in the middle of the stream belong to their request alone
                grpc_client.async_stream_infer("no-such-model", [_text(grpcclient, ["x"])], request_id="bad-model")
                grpc_client.async_stream_infer(MODEL, [_text(grpcclient, ["ok", " "])], request_id="bad-input")
        results, errors = {}, []
        for _ in range(len(batches) + 2):
            result, error = got.get(timeout=120)
            if error is not None:
                errors.append(str(error))
            else:
                results[result.get_response().id] = result.as_numpy("embedding")
        assert set(results) == set(batches)
        for rid, texts in batches.items():
            assert cosine_rows(results[rid], reference_embed(texts)).min() >= 0.99999
        assert len(errors) == 2
        assert any("bad-model" in e and "no-such-model" in e for e in errors), errors
        assert any("bad-input" in e and "empty" in e for e in errors), errors
    finally:
        grpc_client.stop_stream()
    # Without the API key, a stream is refused like any call, as soon as it opens (before any message is
    # read: tests/e2e/test_grpc_unauthenticated.py), so the client may see it closed before it sends; the
    # refusal itself comes to the callback either way.
    grpc_client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        try:
            grpc_client.async_stream_infer(MODEL, [_text(grpcclient, ["no key"])], request_id="nokey")
        except InferenceServerException as exc:
            assert "no longer in valid state" in str(exc)
        result, error = got.get(timeout=60)
        assert result is None and "UNAUTHENTICATED" in str(error.status())
    finally:
        grpc_client.stop_stream()
    # The connection still serves unary calls afterwards.
    out = grpc_client.infer(MODEL, [_text(grpcclient, ["after the stream"])], headers=META).as_numpy("embedding")
    assert out.shape == (1, 384)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_bodies(http_client, reference_embed, sentences, algorithm):
    texts = sentences[50:54]
    result = http_client.infer(MODEL, [_text(httpclient, texts)], headers=dict(AUTH),
                               request_compression_algorithm=algorithm,
                               response_compression_algorithm=algorithm)
    assert cosine_rows(result.as_numpy("embedding"), reference_embed(texts)).min() >= 0.99999


def test_compressed_bodies_are_bounded_and_checked(main_server):
    url = f"{main_server.url}/v2/models/{MODEL}/infer"
    headers = {**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"}
    bomb = gzip.compress(b'{"inputs": [' + b" " * (16 * 1024 * 1024) + b"]}")  # 16 MiB inflated, ~16 KiB sent
    assert len(bomb) < 100_000
    r = httpx.post(url, content=bomb, headers=headers, timeout=60)
    assert r.status_code == 413 and "decompressed" in r.json()["error"]
    r = httpx.post(url, content=b"not gzip at all", headers=headers, timeout=60)
    assert r.status_code == 400 and "gzip" in r.json()["error"]
    r = httpx.post(url, content=b"{}", headers={**headers, "Content-Encoding": "br"}, timeout=60)
    assert r.status_code == 415
    body = b'{"input": ["compressed openai request"]}'
    r = httpx.post(main_server.url + "/v1/embeddings", content=gzip.compress(body), headers=headers, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
    # No API key: refused before anything is inflated.
    r = httpx.post(url, content=bomb, headers={"Content-Encoding": "gzip"}, timeout=60)
    assert r.status_code == 401


def test_log_settings_read_and_set_over_http_and_grpc(http_client, grpc_client):
    start = http_client.get_log_settings(headers=dict(AUTH))
    assert start["log_info"] is True and start["log_verbose_level"] == 0 and start["log_file"] == ""
    try:
        after = http_client.update_log_settings({"log_verbose_level": 1}, headers=dict(AUTH))
        assert after["log_verbose_level"] == 1 and after["log_info"] and after["log_error"]
        seen = grpc_client.get_log_settings(headers=META, as_json=True)["settings"]
        assert seen["log_verbose_level"]["uint32_param"] == 1  # one process-wide level
        after = grpc_client.update_log_settings({"log_verbose_level": 0, "log_info": False}, headers=META,
                                                as_json=True)["settings"]
        assert after["log_info"]["bool_param"] is False and after["log_warning"]["bool_param"] is True
        with pytest.raises(InferenceServerException) as err:  # warning on but error off: no such level
            http_client.update_log_settings({"log_error": False}, headers=dict(AUTH))
        assert "one log level" in str(err.value)
        with pytest.raises(InferenceServerException) as err:
            grpc_client.update_log_settings({"log_file": "/tmp/x.log"}, headers=META)
        assert "UNIMPLEMENTED" in str(err.value.status())
    finally:
        http_client.update_log_settings({"log_info": True, "log_verbose_level": 0}, headers=dict(AUTH))
    assert http_client.get_log_settings(headers=dict(AUTH)) == start


def test_trace_settings_are_readable_and_off(http_client, grpc_client):
    settings = http_client.get_trace_settings(headers=dict(AUTH))
    assert settings["trace_level"] == ["OFF"]
    assert http_client.get_trace_settings(model_name=MODEL, headers=dict(AUTH)) == settings
    assert http_client.update_trace_settings(settings={"trace_level": ["OFF"]}, headers=dict(AUTH)) == settings
    with pytest.raises(InferenceServerException) as err:
        http_client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}, headers=dict(AUTH))
    assert err.value.status() == "501" and "does not trace" in str(err.value)
    got = grpc_client.get_trace_settings(headers=META, as_json=True)["settings"]
    assert got["trace_level"]["value"] == ["OFF"]
    with pytest.raises(InferenceServerException) as err:
        grpc_client.update_trace_settings(settings={"trace_rate": "1"}, headers=META)
    assert "UNIMPLEMENTED" in str(err.value.status())
    with pytest.raises(InferenceServerException) as err:
        grpc_client.get_trace_settings(model_name="no-such-model", headers=META)
    assert "NOT_FOUND" in str(err.value.status())


def test_shared_memory_is_unsupported_with_tritons_statuses(http_client, grpc_client):
    calls = [
        (http_client.get_system_shared_memory_status, (), "501"),
        (http_client.register_system_shared_memory, ("r0", "/surge_r0", 64), "501"),
        (http_client.get_cuda_shared_memory_status, (), "501"),
        (http_client.unregister_cuda_shared_memory, (), "501"),
        (grpc_client.get_system_shared_memory_status, (), "StatusCode.UNIMPLEMENTED"),
        (grpc_client.register_system_shared_memory, ("r0", "/surge_r0", 64), "StatusCode.UNIMPLEMENTED"),
        (grpc_client.get_cuda_shared_memory_status, (), "StatusCode.UNIMPLEMENTED"),
        (grpc_client.unregister_system_shared_memory, (), "StatusCode.UNIMPLEMENTED"),
    ]
    for call, args, status in calls:
        headers = META if "StatusCode" in status else dict(AUTH)
        with pytest.raises(InferenceServerException) as err:
            call(*args, headers=headers)
        assert str(err.value.status()) == status, (call, err.value)
        assert "shared-memory tensors are not supported" in str(err.value)
