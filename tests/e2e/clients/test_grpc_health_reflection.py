"""grpc.health.v1.Health (Check and Watch) and server reflection, with the real
grpcio-health-checking and grpcio-reflection clients against a real server."""

from __future__ import annotations

import queue
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.clients.conftest import API_KEY, AUTH, MODEL

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class _Auth(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the API key to every call (the reflection client takes no metadata)."""

    def _with_key(self, details):
        md = list(details.metadata or []) + [("authorization", f"Bearer {API_KEY}")]
        return details._replace(metadata=md) if hasattr(details, "_replace") else _Details(details, md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_key(details), requests)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression, self.metadata = d.wait_for_ready, d.compression, metadata


def test_check_without_api_key(main_server):
    with grpc.insecure_channel(main_server.grpc_url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "inference.GRPCInferenceService", MODEL, "text-embedding-3-small"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no-such-model"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.skipif(not hasattr(health_pb2, "HealthListRequest"), reason="this grpcio-health-checking has no List")
def test_list_names_every_service_with_its_status_and_needs_the_key(main_server):
    with grpc.insecure_channel(main_server.grpc_url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        with pytest.raises(grpc.RpcError) as err:  # it names the models: not open like Check
            stub.List(health_pb2.HealthListRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        got = stub.List(health_pb2.HealthListRequest(), metadata=[("authorization", f"Bearer {API_KEY}")], timeout=10).statuses
    assert {"", "inference.GRPCInferenceService", MODEL, "text-embedding-3-small"} <= set(got)
    assert all(got[name].status == SERVING for name in got)
    # each entry says what Check says for that name
    with grpc.insecure_channel(main_server.grpc_url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in got:
            assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == got[name].status


def _watch(stub, service: str):
    statuses: queue.Queue = queue.Queue()
    call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=300)

    def pump():
        try:
            for resp in call:
                statuses.put(resp.status)
        except grpc.RpcError:
            pass

    threading.Thread(target=pump, daemon=True).start()
    return call, statuses


def test_watch_follows_unload_and_load(lenient_server):
    http = httpx.Client(base_url=lenient_server.url, headers=AUTH, timeout=300)
    with grpc.insecure_channel(lenient_server.grpc_url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        model_call, model = _watch(stub, MODEL)
        server_call, server = _watch(stub, "")
        unknown_call, unknown = _watch(stub, "no-such-model")
        try:
            assert model.get(timeout=30) == SERVING and server.get(timeout=30) == SERVING
            assert unknown.get(timeout=30) == SERVICE_UNKNOWN  # the stream stays open (health protocol)
            assert http.post(f"/v2/repository/models/{MODEL}/unload").status_code == 200
            assert model.get(timeout=60) == NOT_SERVING and server.get(timeout=60) == NOT_SERVING
            assert stub.Check(health_pb2.HealthCheckRequest(service=MODEL), timeout=10).status == NOT_SERVING
            assert http.post(f"/v2/repository/models/{MODEL}/load").status_code == 200  # returns once warm
            assert model.get(timeout=120) == SERVING and server.get(timeout=120) == SERVING
            r = http.post("/v1/embeddings", json={"input": "served again"})
            assert r.status_code == 200
            assert unknown.empty()  # no change for it: nothing sent
        finally:
            for call in (model_call, server_call, unknown_call):
                call.cancel()
            http.close()


def test_reflection_lists_and_describes_the_services(main_server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(main_server.grpc_url) as raw:
        ch = grpc.intercept_channel(raw, _Auth())
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        pool = DescriptorPool(db)
        infer = pool.FindServiceByName("inference.GRPCInferenceService")
        assert {"ModelInfer", "ServerReady", "ModelMetadata"} <= {m.name for m in infer.methods}
        method = infer.methods_by_name["ModelInfer"]
        assert method.input_type.full_name == "inference.ModelInferRequest"
        assert method.input_type.fields_by_name["raw_input_contents"].number == 7
        health = pool.FindServiceByName("grpc.health.v1.Health")
        # grpcio-health-checking 1.7x added List to the service; older packages describe Check and Watch
        assert {m.name for m in health.methods} - {"List"} == {"Check", "Watch"}


def test_watch_from_process_start_turns_serving_after_warm_up():
    """gRPC starts before the model loads, so a probe can watch the whole start-up:
    NOT_SERVING while loading (when it connects early enough), then SERVING."""
    from tests.server_process import ServerProcess

    srv = ServerProcess("--threads", "1", grpc=True)
    srv.start(wait=False)
    try:
        with grpc.insecure_channel(srv.grpc_url) as ch:
            seen = []
            for resp in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""),
                                                             wait_for_ready=True, timeout=180):
                seen.append(resp.status)
                if resp.status == SERVING:
                    break
        assert seen[-1] == SERVING and set(seen[:-1]) <= {NOT_SERVING}, seen
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200  # SERVING means ready
    finally:
        srv.stop()
