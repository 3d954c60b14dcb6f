"""The KServe v2 gRPC client side against a real grpc server that checks requests against the spec."""

from __future__ import annotations

import asyncio
import struct

import numpy as np

from surge.bench.loadgen import LoadSpec, run_load
from surge.bench.servers import free_port
from surge.bench.workloads import make_workload


def _decode_bytes_tensor(raw: bytes) -> list[str]:
    # KServe/Triton BYTES wire format: each element is a 4-byte little-endian length, then the bytes.
    out, i = [], 0
    while i < len(raw):
        (n,) = struct.unpack_from("<I", raw, i)
        out.append(raw[i + 4 : i + 4 + n].decode("utf-8"))
        i += 4 + n
    return out


def test_kserve_grpc_target_speaks_the_protocol_and_reports_errors():
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    received: list[list[str]] = []

    class Servicer(pb_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request, context):
            assert request.model_name == "mini"
            (inp,) = request.inputs
            assert inp.name == "text" and inp.datatype == "BYTES"
            texts = _decode_bytes_tensor(request.raw_input_contents[0])
            assert list(inp.shape) == [len(texts)]
            received.append(texts)
            if len(received) % 4 == 0:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "shedding load")
            n = len(texts)
            out = pb.ModelInferResponse.InferOutputTensor(name="embedding", datatype="FP32", shape=[n, 2])
            return pb.ModelInferResponse(model_name="mini", outputs=[out],
                                         raw_output_contents=[np.ones((n, 2), np.float32).tobytes()])

    async def main():
        from surge.bench.targets import KServeGRPC

        port = free_port()
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            spec = LoadSpec(mode="closed", concurrency=2, duration_s=20, warmup_s=0, max_requests=40,
                            inputs_per_request=2)
            return await run_load(KServeGRPC(f"127.0.0.1:{port}", "mini"), make_workload(500).stream(), spec)
        finally:
            await server.stop(None)

    r = asyncio.run(main())
    assert r.count == 40
    assert r.errors == {"grpc_UNAVAILABLE": 10}
    assert int(r.ok.sum()) == 30
    assert all(len(t) == 2 and all(isinstance(x, str) and x for x in t) for t in received)


def test_kserve_grpc_nothing_listening():
    from surge.bench.targets import KServeGRPC

    spec = LoadSpec(mode="closed", concurrency=1, duration_s=10, warmup_s=0, max_requests=3)
    r = asyncio.run(run_load(KServeGRPC(f"127.0.0.1:{free_port()}", "mini", timeout_s=2), make_workload(500).stream(),
                             spec))
    assert r.count == 3 and not r.ok.any()
    assert set(r.errors) <= {"grpc_UNAVAILABLE", "timeout"}
