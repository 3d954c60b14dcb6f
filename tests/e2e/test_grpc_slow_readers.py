"""gRPC clients that hold an answer by not reading it, against a real `surge serve` (server/grpc/send_deadline.py;
the HTTP port's twins are in test_slow_readers.py):

- a ModelInfer of many inputs (an answer of MBs) that its client never lets be sent: a raw HTTP/2 client that reads
  its socket (and answers pings) but never grants the stream flow-control window. With --send-timeout-s the server
  cuts the connection and the call's slot of --grpc-max-concurrent-rpcs is freed: with one slot, a grpcio call is
  refused (RESOURCE_EXHAUSTED) while the stalled call holds it, then answered. Before, the call, its answer's
  memory and its slot were held for ever (nothing in grpc.aio or grpc core reaches a call whose answer waits for
  window: the write waits in core, and the status behind it);
- a grpcio client that opens ModelStreamInfer, sends requests and never reads the responses: cut the same way;
- a client that grants window slowly but steadily (each step far within the send timeout, the whole answer far
  beyond it) gets the whole answer, the same as a grpcio client's;
- one that stops reading its socket instead is cut by grpc core itself (TCP_USER_TIMEOUT: its keepalive timeout,
  --grpc-keepalive-timeout-s), send deadline or not.

Every wait is for an outcome (a call answered, the server's closing the socket), bounded far above the send
timeout, never a sleep as an assertion.
"""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import numpy as np
import pytest

from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from tests import metrics_scrape, raw_http2, raw_sockets
from tests.server_process import ServerProcess

SEND_TIMEOUT_S = 2
KEEPALIVE_TIMEOUT_S = 3  # grpc core's keepalive timeout, so its sockets' TCP_USER_TIMEOUT (default 20 s)
WAIT_S = 60  # how long a test waits for an outcome: far above SEND_TIMEOUT_S
MODEL = "all-MiniLM-L6-v2"
INPUTS = 2048  # the most one request may have: 2048 x 384 float32, a 3 MB answer
ANSWER_BYTES = INPUTS * 384 * 4
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
# Channels to one address share a connection unless each has a subchannel pool of its own.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def server():
    # One slot of --grpc-max-concurrent-rpcs: a call that holds it is seen by the next one's refusal. Through
    # SURGE_* variables: a server without the setting still starts, and the tests then fail on what it does.
    env = {"SURGE_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S), "SURGE_GRPC_MAX_CONCURRENT_RPCS": "1"}
    with ServerProcess("--threads", "1", env=env, grpc=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def server_without_send_timeout():
    """The send deadline far away (600 s): what grpc core bounds by itself, after its keepalive timeout
    (--grpc-keepalive-timeout-s, made shorter than its 20 s so that the test does not wait that out)."""
    env = {"SURGE_SEND_TIMEOUT_S": "600", "SURGE_GRPC_MAX_CONCURRENT_RPCS": "1",
           "SURGE_GRPC_KEEPALIVE_TIMEOUT_S": str(KEEPALIVE_TIMEOUT_S)}
    with ServerProcess("--threads", "1", env=env, grpc=True) as srv:
        yield srv


@contextlib.contextmanager
def probing(srv):
    """A grpcio stub on a connection of its own, connected, and the slot free (a test before may have held it),
    before the scene starts."""
    with grpc.insecure_channel(srv.grpc_url, options=OWN_CONNECTION) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S, wait_for_ready=True).live
        deadline = time.monotonic() + WAIT_S
        while live(stub) != grpc.StatusCode.OK and time.monotonic() < deadline:
            time.sleep(0.1)
        yield stub


@pytest.fixture
def probe(server):
    with probing(server) as stub:
        yield stub


def infer_request(n: int = INPUTS, tag: str = "") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=MODEL, id=tag)
    req.inputs.add(name="text", datatype="BYTES", shape=[n]).contents.bytes_contents.extend(
        f"slow reader {tag} {i}".encode() for i in range(n))
    return req


def live(stub) -> grpc.StatusCode:
    try:
        stub.ServerLive(pb.ServerLiveRequest(), timeout=WAIT_S)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def refused_then_answered(stub) -> bool:
    """The one slot is held (a call is refused), then freed by the server by itself (a call is answered)."""
    assert live(stub) == grpc.StatusCode.RESOURCE_EXHAUSTED
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if live(stub) == grpc.StatusCode.OK:
            return True
        time.sleep(0.2)
    return False


def answered_call(port: int, request: pb.ModelInferRequest, connect=raw_sockets.connect):
    """A raw connection whose ModelInfer call (stream 1) is being answered: returns once the answer's first DATA has
    come (the socket, its frame reader, that frame's payload). A call refused at once is made again on a fresh
    connection: grpc.aio frees a call's slot only once the call's task has ended, a moment after its client has the
    answer, so that the probe's last call may still hold the one slot."""
    for _ in range(5):
        s = connect(port, WAIT_S)
        reader = raw_http2.handshake(s)
        s.sendall(raw_http2.grpc_headers(1, MODEL_INFER, f"127.0.0.1:{port}")
                  + raw_http2.grpc_data(1, request.SerializeToString()))
        while True:
            kind, flags, stream_id, payload = reader.next()
            if stream_id != 1:
                continue
            if kind == raw_http2.DATA:
                return s, reader, payload
            if kind == raw_http2.RST_STREAM or flags & raw_http2.END_STREAM:  # refused (a status, no answer)
                s.close()
                break
    raise AssertionError("the call was refused every time")


class FramesWithoutWindow(threading.Thread):
    """Reads every frame the server sends (answering its pings) and never grants window, until the server closes
    the connection."""

    def __init__(self, reader: raw_http2.FrameReader, first: bytes):
        super().__init__(daemon=True)
        self.reader, self.data, self.ended = reader, len(first), None

    def run(self):
        try:
            while True:
                kind, _, stream_id, payload = self.reader.next()
                if kind == raw_http2.DATA and stream_id == 1:
                    self.data += len(payload)
        except OSError as exc:  # ConnectionError: the server closed it; socket.timeout: it did not
            self.ended = exc


def failures_since(srv, before: dict, expected: int) -> dict:
    """/metrics once the model's failures have grown by `expected` since `before` (or WAIT_S has passed): a cut
    call is counted when grpc.aio ends it, a moment after its slot is seen free."""
    deadline = time.monotonic() + WAIT_S
    while True:
        after = metrics_scrape.scrape(srv.url, MODEL)
        if metrics_scrape.total(before, after, "surge_request_failures_total") >= expected \
                or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def answered(before: dict, after: dict) -> float:
    """The model's requests counted answered since `before`: its latency histogram's observations."""
    return metrics_scrape.delta(before, after, "surge_request_latency_seconds_count")


def successes(stub) -> int:
    """The model's KServe statistics: its requests counted successful (ModelStatistics)."""
    stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL), timeout=WAIT_S).model_stats
    return sum(s.inference_stats.success.count for s in stats)


def failure_codes(before: dict, after: dict) -> dict[str, float]:
    return {dict(labels)["code"]: v - before.get((name, labels), 0.0) for (name, labels), v in after.items()
            if name == "surge_request_failures_total" and v != before.get((name, labels), 0.0)}


def test_a_unary_answer_never_granted_window_is_cut_and_frees_its_slot(server, probe):
    """...and the cut call counts once, as a failure, as a client that left ("cancelled"), the same as the HTTP
    port's cut answer (test_slow_readers.py), not also as one answered: its latency is not observed, and the KServe
    statistics count no success for it (before, it counted both: answered when computed, then cancelled)."""
    before, successes_before = metrics_scrape.scrape(server.url, MODEL), successes(probe)
    s, reader, first = answered_call(server.grpc_port, infer_request(tag="window"))
    with s:
        frames = FramesWithoutWindow(reader, first)
        frames.start()
        assert refused_then_answered(probe)
        frames.join(WAIT_S)
    assert isinstance(frames.ended, ConnectionError), frames.ended  # the server cut the connection
    assert frames.data < ANSWER_BYTES  # not sent whole
    after = failures_since(server, before, 1)
    assert metrics_scrape.delta(before, after, "surge_requests_total") == 1
    assert failure_codes(before, after) == {"cancelled": 1}
    assert answered(before, after) == 0
    assert successes(probe) == successes_before


def test_a_unary_answer_whose_socket_is_not_read_is_cut_by_grpc_core(server_without_send_timeout):
    """A client that stops reading its socket (its TCP window closes) is cut without the send deadline: grpc core
    sets TCP_USER_TIMEOUT (its keepalive timeout, --grpc-keepalive-timeout-s) on the connections it accepts, and Linux ends a connection
    whose window has stayed shut that long. The send deadline is for what this leaves: clients that read their
    socket and withhold HTTP/2 window (the tests above and below)."""
    srv = server_without_send_timeout
    with probing(srv) as probe:
        s, _, _ = answered_call(srv.grpc_port, infer_request(tag="socket"), raw_sockets.connect_reading_slowly)
        with s:
            assert refused_then_answered(probe)
            got = raw_sockets.read_to_close(s)  # what the kernels held, then the reset (socket.timeout if held)
    assert len(got) < ANSWER_BYTES


def test_a_stream_whose_responses_are_never_read_is_cut_and_frees_its_slot(server, probe):
    """A real client (grpcio, BDP probing off so that its window stays at its 64 KiB default) sends 16 requests of
    256 inputs on ModelStreamInfer (responses of 393 KB each) and never reads a response. No request counts as
    answered but one whose response the client took whole (none, or the first: grpc core may take one message
    ahead of the application): those admitted count as "cancelled", cut while computed or with their responses
    computed and unwritten (being sent, or waiting to be); the rest were refused ("overloaded": over
    the queued inputs admission allows). Each request counts once: answered (its latency observed) or a failure.
    Before, those computed were counted answered, and those of them lost cancelled as well.
    """
    options = [*OWN_CONNECTION, ("grpc.http2.bdp_probe", 0)]
    before = metrics_scrape.scrape(server.url, MODEL)
    with grpc.insecure_channel(server.grpc_url, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(5):  # a stream refused at once (the probe's last call still held the slot) is made again
            call = stub.ModelStreamInfer(iter([infer_request(256, f"s{i}") for i in range(16)]), timeout=WAIT_S)
            deadline = time.monotonic() + WAIT_S  # the stream holds the slot once the server has taken it
            while live(probe) == grpc.StatusCode.OK and not call.done() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not call.done():
                break
            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.code()
        assert refused_then_answered(probe)
        received = 0
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:  # what the client had taken whole before the cut, then the cut
                received += 1
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert received < 16
    after = failures_since(server, before, 16 - received)
    assert metrics_scrape.delta(before, after, "surge_requests_total") == 16
    codes = failure_codes(before, after)
    assert set(codes) <= {"cancelled", "overloaded"} and sum(codes.values()) == 16 - received, codes
    assert codes.get("cancelled", 0) >= 1, codes
    assert answered(before, after) == received, (answered(before, after), codes)


def test_a_client_granting_window_slowly_but_steadily_is_never_cut(server, probe):
    """128 KiB of window every SEND_TIMEOUT_S / 8 (512 KiB/s at 2 s): the 3 MB answer takes ~6 s, 3 times the send
    timeout, and arrives whole, as grpcio's answer to the same request; both count answered, once each, when
    written (the slow one long after it was computed)."""
    request = infer_request(tag="steady")
    before = metrics_scrape.scrape(server.url, MODEL)
    reference = probe.ModelInfer(request, timeout=WAIT_S)
    step = 131072
    start = time.monotonic()
    s, reader, body = answered_call(server.grpc_port, request)
    with s:
        granted, ended = 65535, False  # the default initial windows, connection's and stream's
        while not ended:
            kind, flags, stream_id, payload = reader.next()
            assert kind not in (raw_http2.RST_STREAM, raw_http2.GOAWAY), payload
            if stream_id != 1:
                continue
            if kind == raw_http2.DATA:
                body += payload
            ended = bool(flags & raw_http2.END_STREAM)
            if not ended and len(body) >= granted:  # all it may send has come: pause, grant more
                time.sleep(SEND_TIMEOUT_S / 8)
                s.sendall(raw_http2.window_update(0, step) + raw_http2.window_update(1, step))
                granted += step
    assert time.monotonic() - start > 2 * SEND_TIMEOUT_S  # the case this checks: slower than the timeout
    assert int.from_bytes(body[1:5], "big") == len(body) - 5  # one message, whole
    answer = pb.ModelInferResponse.FromString(body[5:])
    np.testing.assert_allclose(np.frombuffer(answer.raw_output_contents[0], "<f4"),
                               np.frombuffer(reference.raw_output_contents[0], "<f4"), rtol=1e-5, atol=1e-6)
    deadline = time.monotonic() + WAIT_S  # counted when grpc.aio ends the call, a moment after the client has it
    while answered(before, after := metrics_scrape.scrape(server.url, MODEL)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert answered(before, after) == 2
    assert metrics_scrape.delta(before, after, "surge_requests_total") == 2
    assert failure_codes(before, after) == {}
