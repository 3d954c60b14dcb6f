"""The gRPC port's bounds on what a client can hold, against a real `surge serve` (grpcio clients, and raw
sockets where the attack is in what is *not* sent). The HTTP port's twins are in test_slow_clients.py.

Before, the gRPC port had none: a connection that sent nothing, or an HTTP/2 connection with no call, was
held for ever; connections and calls in flight were unbounded (each call may hold a 2 MB message); and
metadata was bounded only by grpcio's default. Now (server/grpc/server.py):

- --request-read-timeout-s: a connection whose HTTP/2 handshake has not finished, or that has had no call
  in flight, for that long is closed (GOAWAY); a real client reconnects at its next call; a call whose
  one message has not come for that long gets DEADLINE_EXCEEDED (a request stream may wait) and frees its slot (before,
  it held it until its connection went);
- --max-connections: one connection more is closed at once, before anything is read from it;
- --grpc-max-concurrent-rpcs: one call more gets RESOURCE_EXHAUSTED at once;
- --max-header-bytes: larger metadata gets RESOURCE_EXHAUSTED;
- by default the gRPC port takes at most half the descriptors left after the process's own, so that idle
  gRPC connections cannot stop HTTP from accepting;
- --grpc-max-connection-age-s (opt-in): calls still in flight go with their connection.

Every wait is for an outcome (the server's answer, its closing the socket, the channel's state), bounded far
above the configured timeout, never a sleep.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from surge.bench.servers import ServerProc, free_port
from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from tests import raw_http2, raw_sockets
from tests.e2e.repo_helpers import add_version
from tests.server_process import ROOT, ServerProcess

READ_TIMEOUT_S = 3
MAX_CONNECTIONS = 4
MAX_RPCS = 8
MAX_HEADER_BYTES = 4096
WAIT_S = 60  # how long a test waits for an outcome: far above READ_TIMEOUT_S
# For a connection that sends nothing: still far above READ_TIMEOUT_S, below the 60 s after which grpcio closes
# a connection that never acknowledged its SETTINGS (the only bound there was).
SILENT_WAIT_S = 30
# The client's HTTP/2 connection preface and an empty SETTINGS frame; the acknowledgement of the server's.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
# Channels to one address share a connection unless each has a subchannel pool of its own.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
SETTINGS, GOAWAY = 0x04, 0x07


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc_limits")
    add_version(root, "enc", 1)
    # Through SURGE_* variables: a server without these settings still starts, and the tests then fail on
    # what it does rather than on an unknown flag.
    env = {"SURGE_REQUEST_READ_TIMEOUT_S": str(READ_TIMEOUT_S), "SURGE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
           "SURGE_GRPC_MAX_CONCURRENT_RPCS": str(MAX_RPCS), "SURGE_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES)}
    with ServerProcess("--model-repository", str(root), "--threads", "1", env=env, grpc=True) as srv:
        yield srv




def frame_types(raw: bytes) -> list[int]:
    """The types of the HTTP/2 frames in `raw` (9-byte headers: 24-bit length, type, flags, stream id)."""
    types, i = [], 0
    while i + 9 <= len(raw):
        types.append(raw[i + 3])
        i += 9 + int.from_bytes(raw[i:i + 3], "big")
    return types


def infer(stub, text: str = "still serving", **kw) -> np.ndarray:
    req = pb.ModelInferRequest(model_name="enc")
    req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text.encode())
    return np.frombuffer(stub.ModelInfer(req, timeout=WAIT_S, **kw).raw_output_contents[0], dtype="<f4")


def serves(url: str) -> bool:
    """A normal call on a fresh channel answers (retried while the server sees earlier connections close)."""
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        with grpc.insecure_channel(url) as channel:
            try:
                return infer(pb_grpc.GRPCInferenceServiceStub(channel)).shape == (384,)
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
    return False


def test_a_connection_that_sends_nothing_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=SILENT_WAIT_S) as s:
        raw_sockets.read_to_close(s)  # socket.timeout (the test fails) if the server holds it


def test_a_connection_without_calls_is_closed_with_goaway(server):
    """A well-behaved HTTP/2 client (preface, SETTINGS acknowledged) that starts no call."""
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=WAIT_S) as s:
        s.sendall(PREFACE)
        raw = s.recv(65536)
        assert frame_types(raw)[:1] == [SETTINGS], raw
        s.sendall(SETTINGS_ACK)
        raw += raw_sockets.read_to_close(s)
    assert GOAWAY in frame_types(raw), raw


def test_an_idle_client_channel_is_closed_and_reconnects(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        first = infer(stub)
        ready = grpc.ChannelConnectivity.READY
        states: list = []
        channel.subscribe(states.append)
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end and (not states or states[-1] == ready):
            time.sleep(0.05)
        channel.unsubscribe(states.append)
        assert states and states[-1] != ready, states  # the server sent GOAWAY: the channel left READY
        np.testing.assert_array_equal(infer(stub), first)  # the next call reconnects


async def _watch(stub) -> grpc.aio.Call:
    """A health Watch: a call that stays in flight (and keeps its connection from being idle)."""
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    first = await asyncio.wait_for(call.read(), WAIT_S)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    return call


def test_calls_over_the_limit_get_resource_exhausted(server):
    async def run():
        async with grpc.aio.insecure_channel(server.grpc_url) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [await _watch(health) for _ in range(MAX_RPCS)]
            try:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            finally:
                for call in watches:
                    call.cancel()
            end = time.monotonic() + WAIT_S  # the cancels reach the server: calls are answered again
            while True:
                try:
                    return (await stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S)).live
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
                        raise

    assert asyncio.run(run())


# A unary-request call of each kind the port serves: a unary answer (ModelInfer, ServerLive, health Check), a
# response stream (health Watch). Request streams may wait for their first message (read_deadline.py).
STALLED_PATHS = ["/inference.GRPCInferenceService/ModelInfer", "/inference.GRPCInferenceService/ServerLive",
                 "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/Check"]


def test_calls_whose_message_never_comes_are_ended_and_free_their_slots(server):
    """A raw HTTP/2 client fills every one of --grpc-max-concurrent-rpcs with calls that send their HEADERS and
    never their message (DATA): a grpcio call is refused (RESOURCE_EXHAUSTED) while they hold the slots; within
    --request-read-timeout-s each stalled stream is ended (its status, then RST_STREAM) and a grpcio call is
    answered. Before, nothing ended them: they held the slots until their connection went.

    The refusal must be seen within the read timeout (the deadline then frees the slots): the probing channel
    is connected first, and the whole scene is tried again when no probe was refused in time (a loaded machine,
    or slots an earlier test's calls still held)."""
    ids = [2 * n + 1 for n in range(MAX_RPCS)]
    with grpc.insecure_channel(server.grpc_url, options=OWN_CONNECTION) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S, wait_for_ready=True).live
        for _ in range(5):
            with raw_sockets.connect(server.grpc_port, WAIT_S) as s:
                reader = raw_http2.handshake(s)
                until = time.monotonic() + READ_TIMEOUT_S
                s.sendall(b"".join(raw_http2.grpc_headers(i, STALLED_PATHS[n % len(STALLED_PATHS)], server.grpc_url)
                                   for n, i in enumerate(ids)))
                if not _refused_before(stub, until):
                    continue
                ended: dict[int, list[str]] = {i: [] for i in ids}
                while not all("RST_STREAM" in got for got in ended.values()):
                    kind, flags, stream_id, _ = reader.next()  # socket.timeout (the test fails) if they are held
                    if stream_id in ended and kind == raw_http2.HEADERS and flags & raw_http2.END_STREAM:
                        ended[stream_id].append("status")
                    elif stream_id in ended and kind == raw_http2.RST_STREAM:
                        ended[stream_id].append("RST_STREAM")
                assert all(got == ["status", "RST_STREAM"] for got in ended.values()), ended
                assert serves(server.grpc_url)  # the slots are free again
                return
    pytest.fail("in 5 tries no grpcio call was refused while the stalled calls held the slots")


def _refused_before(stub, until: float) -> bool:
    """Probe calls until one is refused (RESOURCE_EXHAUSTED: True) or `until` (time.monotonic()) passes."""
    while time.monotonic() < until:
        try:
            stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            return True
    return False


def _raw_call(channel, path: str, streaming_response: bool):
    """A multi-callable that sends and takes bytes (no protobuf), request-streaming whatever the method is: a
    grpcio client's way to start a call and send its message only when (if ever) the iterator yields it. Its
    calls are made wait_for_ready: the connection limit may still count connections earlier tests have just
    closed, and a call then waits for its connection instead of failing UNAVAILABLE."""
    return (channel.stream_stream if streaming_response else channel.stream_unary)(path)


def test_a_call_whose_message_never_comes_gets_deadline_exceeded(server):
    """grpcio clients that start unary-request calls and never send their message: each call ends,
    DEADLINE_EXCEEDED with a message that names the setting, after --request-read-timeout-s (before: never, the
    calls hung). A request stream opened beside them and silent as long is not ended: its first message, sent
    after that, is answered (Triton's client opens its stream before it has a request)."""
    req = pb.ModelInferRequest(model_name="enc")
    req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a late first message")

    async def run():
        never, go = asyncio.Event(), asyncio.Event()

        async def nothing():
            await never.wait()
            yield b""

        async def later():
            await go.wait()
            yield req.SerializeToString()

        async with grpc.aio.insecure_channel(server.grpc_url, options=OWN_CONNECTION) as channel:
            calls = [_raw_call(channel, path, streaming)(nothing(), wait_for_ready=True) for path, streaming in (
                ("/inference.GRPCInferenceService/ModelInfer", False), ("/grpc.health.v1.Health/Watch", True))]
            stream = _raw_call(channel, "/inference.GRPCInferenceService/ModelStreamInfer", True)(later(),
                                                                                                   wait_for_ready=True)
            try:
                ended = await asyncio.wait_for(asyncio.gather(*(asyncio.gather(c.code(), c.details())
                                                                for c in calls)), WAIT_S)
                go.set()  # the stream has been silent past the read timeout: the calls above were ended by it
                return ended, await asyncio.wait_for(stream.read(), WAIT_S)
            finally:
                for call in (*calls, stream):
                    call.cancel()

    ended, answer = asyncio.run(run())
    for code, details in ended:
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
        assert "--request-read-timeout-s" in details, details
    answer = pb.ModelStreamInferResponse.FromString(answer)
    assert not answer.error_message, answer.error_message
    assert np.frombuffer(answer.infer_response.raw_output_contents[0], dtype="<f4").shape == (384,)
    assert serves(server.grpc_url)


def test_a_call_closed_without_its_message(server):
    """A unary call whose client half-closes without sending its message gets a clear error at once (before, the
    server answered nothing and the call hung); a request stream with no message is a stream with none, as
    before: ModelStreamInfer answers OK with no response."""

    async def run():
        async def none():
            return
            yield

        async with grpc.aio.insecure_channel(server.grpc_url, options=OWN_CONNECTION) as channel:
            unary = _raw_call(channel, "/inference.GRPCInferenceService/ModelInfer", False)(none(), wait_for_ready=True)
            stream = _raw_call(channel, "/inference.GRPCInferenceService/ModelStreamInfer", True)(none(),
                                                                                                   wait_for_ready=True)
            return await asyncio.wait_for(asyncio.gather(unary.code(), unary.details(), drain(stream),
                                                         stream.code()), WAIT_S)

    async def drain(call) -> list:
        return [r async for r in call]

    code, details, responses, stream_code = asyncio.run(run())
    assert code == grpc.StatusCode.INTERNAL and "without its request message" in details, (code, details)
    assert stream_code == grpc.StatusCode.OK and responses == []


def test_a_burst_of_calls_is_answered_or_refused_never_held(server):
    async def run():
        req = pb.ModelInferRequest(model_name="enc")
        req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"burst")
        async with grpc.aio.insecure_channel(server.grpc_url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def one():
                try:
                    await stub.ModelInfer(req, timeout=WAIT_S * 2)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    return exc.code()

            return await asyncio.gather(*(one() for _ in range(MAX_RPCS * 8)))

    codes = asyncio.run(run())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert grpc.StatusCode.OK in codes
    assert serves(server.grpc_url)


def test_connections_over_the_limit_are_closed_at_once(server):
    async def run():
        held, refused = [], None  # channels, each kept busy (so not idle) by a Watch
        try:
            # Open until one is refused: the limit may be met early where earlier tests' closed connections
            # have not yet reached the server.
            for _ in range(MAX_CONNECTIONS + 1):
                channel = grpc.aio.insecure_channel(server.grpc_url, options=OWN_CONNECTION)
                try:
                    held.append((channel, await _watch(health_pb2_grpc.HealthStub(channel))))
                except grpc.aio.AioRpcError as exc:
                    refused = exc
                    await channel.close()
                    break
            assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE, (len(held), refused)
            assert 1 <= len(held) <= MAX_CONNECTIONS
            with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=WAIT_S) as s:
                s.sendall(PREFACE)
                raw = raw_sockets.read_to_close(s)  # an accepted one gets the server's SETTINGS first
            assert raw == b"", raw
        finally:
            for channel, call in held:
                call.cancel()
                await channel.close()

    asyncio.run(run())
    assert serves(server.grpc_url)


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 2000, 1 << 20])
def test_metadata_over_the_limit_is_refused(server, size):
    """(UNAVAILABLE: the connection limit still counted connections that earlier tests had just closed; the
    call is made again, until the server takes the connection.)"""
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        end = time.monotonic() + WAIT_S
        while True:
            with pytest.raises(grpc.RpcError) as info:
                stub.ServerLive(pb.ServerLiveRequest(), metadata=[("x-padding", "a" * size)], timeout=WAIT_S)
            if info.value.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                break
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert stub.ServerLive(pb.ServerLiveRequest(), metadata=[("x-padding", "a" * 2000)], timeout=WAIT_S).live


def test_normal_calls_still_work(server):
    assert serves(server.grpc_url)


def test_idle_grpc_connections_leave_the_process_its_file_descriptors(tmp_path):
    """A server whose process may open 400 files, 450 idle gRPC connections: by default the gRPC port takes
    at most half of what the 256 kept for the process's own files leave, so HTTP still answers and a gRPC
    connection over the limit is closed, where before they all took descriptors until the process could
    accept nothing (EMFILE): /health hung."""
    add_version(tmp_path, "enc", 1)
    port, grpc_port = free_port(), free_port()
    argv = ["surge", "serve", "--port", str(port), "--grpc-port", str(grpc_port), "--model-repository",
            str(tmp_path), "--threads", "1"]
    boot = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400)); "
            f"sys.argv = {argv!r}; runpy.run_module('surge.cli.main', run_name='__main__')")
    with ServerProc("surge-serve-nofile", [sys.executable, "-c", boot], port, ready_timeout_s=180,
                    env={"SURGE_REQUEST_READ_TIMEOUT_S": "600"}, cwd=ROOT) as srv:
        held = [socket.create_connection(("127.0.0.1", grpc_port), timeout=WAIT_S) for _ in range(450)]
        try:
            assert httpx.get(srv.url + "/health", timeout=WAIT_S).status_code == 200
            with socket.create_connection(("127.0.0.1", grpc_port), timeout=WAIT_S) as s:
                s.sendall(PREFACE)
                assert raw_sockets.read_to_close(s) == b""  # over the limit: closed at once
        finally:
            for s in held:
                s.close()
        assert serves(f"127.0.0.1:{grpc_port}"), srv.output()
        assert srv.proc.poll() is None


@pytest.fixture(scope="module")
def aged(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc_aged")
    add_version(root, "enc", 1)
    env = {"SURGE_GRPC_MAX_CONNECTION_AGE_S": "2", "SURGE_REQUEST_TIMEOUT_S": "3",
           "SURGE_GRPC_MAX_CONCURRENT_RPCS": "2"}
    with ServerProcess("--model-repository", str(root), "--threads", "1", env=env, grpc=True) as srv:
        yield srv


def test_calls_whose_request_never_comes_go_with_their_connection(aged):
    """A client that starts calls and never sends their message holds the concurrent calls (new ones get
    RESOURCE_EXHAUSTED) until --grpc-max-connection-age-s, plus --request-timeout-s of grace, cuts them (here
    before --request-read-timeout-s, 60 s by default, would)."""

    async def run():
        async with grpc.aio.insecure_channel(aged.grpc_url, options=OWN_CONNECTION) as channel:
            silent = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                          request_serializer=pb.ModelInferRequest.SerializeToString,
                                          response_deserializer=pb.ModelInferResponse.FromString)
            never = asyncio.Event()

            async def nothing():
                await never.wait()
                yield pb.ModelInferRequest()

            async with grpc.aio.insecure_channel(aged.grpc_url, options=OWN_CONNECTION) as other:
                stub = pb_grpc.GRPCInferenceServiceStub(other)
                calls: list = []
                end = time.monotonic() + WAIT_S
                while True:
                    # Two silent calls in flight (one refused because a probe held a slot is replaced), until a
                    # probe is refused: then both hold a slot.
                    calls = [c for c in calls if not c.done()]
                    calls += [silent(nothing()) for _ in range(2 - len(calls))]
                    try:
                        await stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S)
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                        break
                    assert time.monotonic() < end, "the silent calls never took the slots"
                codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)), WAIT_S)
                # the calls that held slots go with the connection; one refused at once (RESOURCE_EXHAUSTED: a
                # probe's slot not yet freed when it came) may still be in the list
                assert grpc.StatusCode.UNAVAILABLE in codes, codes
                assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
                end = time.monotonic() + WAIT_S
                while True:  # the slots are free again
                    try:
                        return (await stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S)).live
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
                            raise

    assert asyncio.run(run())
    assert serves(aged.grpc_url)
