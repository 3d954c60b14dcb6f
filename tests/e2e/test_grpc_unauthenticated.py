"""gRPC with --api-key: a request without the key is refused before its message is read.

The key is checked on the call's metadata, but the refusal was a unary handler, so gRPC first read
and assembled each request message (up to the 2 MB limit) and only then refused it: a client without
the key that sent a few hundred 2 MB messages at once made the server hold hundreds of MB (measured:
400 of them, +300 MB peak RSS). The refusal is now a streaming handler that never reads the request.
Measured on the real server's peak RSS (VmHWM), with grpcio's asyncio client.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess

KEY = "grpc-unauth-key"
CALLS = 300
MESSAGE = 2 * 1024 * 1024 - 1024  # just under the server's limit (--max-body-bytes, 2 MiB)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc_unauth")
    add_version(root, "enc", 1)
    with ServerProcess("--model-repository", str(root), "--threads", "1", "--api-key", KEY, grpc=True) as srv:
        yield srv


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


async def _calls(url: str, metadata) -> list:
    request = pb.ModelInferRequest(model_name="enc", raw_input_contents=[b"x" * MESSAGE])
    channels = [grpc.aio.insecure_channel(url, options=[("grpc.max_send_message_length", 1 << 30)])
                for _ in range(4)]
    try:
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]

        async def one(i):
            try:
                await stubs[i % len(stubs)].ModelInfer(request, metadata=metadata, timeout=120)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        return await asyncio.gather(*(one(i) for i in range(CALLS)))
    finally:
        for c in channels:
            await c.close()


def test_large_messages_without_the_key_are_not_read(server):
    before = peak_rss_kb(server.proc.pid)
    codes = asyncio.run(_calls(server.grpc_url, [("authorization", "Bearer wrong")]))
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
    assert peak_rss_kb(server.proc.pid) - before < 64 * 1024  # KiB: before the fix, ~1 MB per call


def test_with_the_key_calls_still_work(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        auth = [("authorization", f"Bearer {KEY}")]
        assert stub.ServerLive(pb.ServerLiveRequest()).live  # open, as before
        meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="enc"), metadata=auth)
        assert meta.name == "enc"
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelMetadata(pb.ModelMetadataRequest(name="enc"))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A server-streaming call refused the same way.
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name="enc")])))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
