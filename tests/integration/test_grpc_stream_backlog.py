"""ModelStreamInfer holds a bounded number of answers for a client that does not take them (server/grpc/extras.py).

A real grpcio client (BDP probing off, so that its stream window stays at 64 KiB) sends many requests on one
stream and reads no response for a while, as a slow reader that --send-timeout-s never cuts may. The server answers
requests as they arrive; before, each answer went into the stream's unbounded queue, so the server computed every
request the client sent and held every answer (here ~10 MB for 400 requests, growing with the count). Now the
stream stops reading requests once STREAM_WAITING answers wait to be sent, so what it holds is bounded; once the
client reads, every request is answered, each under its own id.

The server runs in this process (the real app under uvicorn, its gRPC port started with it) so that the requests it
computed can be read off its KServe statistics. The wait is for an outcome (every request computed, or the count of
computed requests no longer moving), bounded far above either; the bound asserted never depends on speed.
"""

from __future__ import annotations

import time

import grpc
import pytest

from surge.server.grpc import extras
from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from tests.integration.test_direct_http import InProcessServer, _free_port

pytestmark = pytest.mark.timeout(300)

MODEL = "all-MiniLM-L6-v2"
INPUTS = 16  # a 24 KiB answer: a few of them fill the client's stream window
REQUESTS = 400
WAIT_S = 120


def _request(tag: str) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=MODEL, id=tag)
    # The same texts in every request: answered from the cache after the first, the stream runs at full speed.
    req.inputs.add(name="text", datatype="BYTES", shape=[INPUTS]).contents.bytes_contents.extend(
        f"a stream's waiting answers {i}".encode() for i in range(INPUTS))
    return req


def _computed(srv) -> int:
    """Requests the server has answered on its side (its KServe statistics count inputs)."""
    service = srv.state.registry.get(MODEL)
    return srv.state.stats.model(service.name, service.version).inference_count // INPUTS


def test_a_stream_whose_answers_are_not_taken_holds_a_bounded_number_of_them():
    grpc_port = _free_port()
    # A send timeout far above the test: the client's pause must not be cut.
    with InProcessServer(grpc_port=grpc_port, limits={"send_timeout_s": 3600}) as srv:
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            before = _computed(srv)
            call = stub.ModelStreamInfer(iter([_request(f"r{i}") for i in range(REQUESTS)]), timeout=WAIT_S * 2)
            end, seen, still_since = time.monotonic() + WAIT_S, -1, time.monotonic()
            while True:  # every request computed (the old way), or none more for a while (held back: the new)
                done = _computed(srv) - before
                if done >= REQUESTS or time.monotonic() > end:
                    break
                if done != seen:
                    seen, still_since = done, time.monotonic()
                elif done > 0 and time.monotonic() - still_since > 3:
                    break
                time.sleep(0.05)
            # the waiting answers, those on their way to the queue (one per request in flight), and what
            # grpc took into the stream's window
            bound = extras.STREAM_WAITING + extras.STREAM_INFLIGHT + 16
            assert done <= bound, f"{done} requests computed and held for a client that took no answer"
            answers = list(call)  # the client reads: every request is answered
    assert len(answers) == REQUESTS
    assert all(not a.error_message for a in answers), answers[0].error_message
    assert sorted(a.infer_response.id for a in answers) == sorted(f"r{i}" for i in range(REQUESTS))
    assert all(list(a.infer_response.outputs[0].shape) == [INPUTS, 384] for a in answers)
