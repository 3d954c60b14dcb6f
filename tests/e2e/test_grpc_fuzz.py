"""A bounded fuzz of the gRPC service (KServe v2) of a real `surge serve`.

Hypothesis builds requests from the pieces a client controls: model names and
versions (valid, unknown, path-like, huge), tensors with any datatype, shape
(negative, zero, huge) and contents, raw_input_contents of any size or count,
parameters of any kind. Every answer must be a success or a proper status
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, ...), never INTERNAL or
UNKNOWN; a success must have one embedding row per input. The server is
healthy and right afterwards.
"""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from tests.server_process import ServerProcess

MODEL = "all-MiniLM-L6-v2"
EXAMPLES = 150
CLEAN = "clean-request"
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
DATATYPES = ["BYTES", "INT64", "INT32", "FP32", "FP16", "FP64", "BOOL", "UINT64", "UINT8", "INT8", "BF16", ""]
CONTENT_FIELDS = {"bytes_contents": st.binary(max_size=40), "int64_contents": st.integers(-(2 ** 63), 2 ** 63 - 1),
                  "int_contents": st.integers(-(2 ** 31), 2 ** 31 - 1), "fp32_contents": st.floats(width=32),
                  "bool_contents": st.booleans(), "uint64_contents": st.integers(0, 2 ** 64 - 1)}


@pytest.fixture(scope="module")
def stub():
    with ServerProcess("--threads", "1", "--max-inputs", "8", "--max-body-bytes", "65536", grpc=True) as srv:
        with grpc.insecure_channel(srv.grpc_url) as channel:
            yield pb_grpc.GRPCInferenceServiceStub(channel)


names = st.one_of(st.sampled_from([MODEL, "", "../x", "a/../../etc", MODEL + "/.", "x" * 5000]), st.text(max_size=30))
versions = st.one_of(st.sampled_from(["", "1", "2", "-1", "01", "1.0", "9" * 40]), st.text(max_size=8))
shapes = st.lists(st.one_of(st.integers(-3, 5), st.sampled_from([2 ** 31, 2 ** 40, 2 ** 62, 2 ** 63 - 1])),
                  max_size=4)


@st.composite
def tensors(draw):
    name = draw(st.one_of(st.sampled_from(["text", "input_ids", "attention_mask", "embedding"]), st.text(max_size=12)))
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(shapes)
    contents = None
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(CONTENT_FIELDS)))
        contents = (field, draw(st.lists(CONTENT_FIELDS[field], max_size=6)))
    return name, datatype, shape, contents


@st.composite
def near_valid(draw, clean: bool = False):
    """Tensors a client of this model would send, with one thing off now and then (never when clean)."""
    n = draw(st.integers(1, 8)) if clean or draw(st.integers(0, 4)) else draw(st.sampled_from([0, 9]))  # 8: --max-inputs
    off = 0 if clean or draw(st.integers(0, 4)) else draw(st.sampled_from([-1, 1]))
    if draw(st.booleans()):
        word = st.text(st.characters(codec="utf-8", categories=["L", "N"]), min_size=1, max_size=30)
        if not clean:
            word = st.one_of(word, st.text(st.characters(codec="utf-8"), max_size=30))
        texts = draw(st.lists(word, min_size=max(0, n + off), max_size=max(0, n + off)))
        shape = draw(st.sampled_from([[n], [n, 1]] if clean else [[n], [n, 1], [1, n]]))
        return [("text", "BYTES", shape, ("bytes_contents", [t.encode() for t in texts]))]
    length = draw(st.integers(1, 6)) if clean or draw(st.integers(0, 4)) else 0
    good_id = st.integers(0, 30521)
    ids = draw(st.lists(good_id if clean else st.one_of(good_id, st.sampled_from([-1, 30522, 2 ** 62])),
                        min_size=max(0, n * length + off), max_size=max(0, n * length + off)))
    datatype = "INT64" if clean else draw(st.sampled_from(["INT64", "INT32"]))  # INT32 rides in int_contents
    out = [("input_ids", datatype, [n, length], ("int64_contents", ids))]
    if draw(st.booleans()):
        values = [1] if clean else [0, 1, 2]
        mask = draw(st.lists(st.sampled_from(values), min_size=n * length, max_size=n * length))
        out.append(("attention_mask", "INT64", [n, length] if clean else draw(st.sampled_from([[n, length], [length, n]])),
                    ("int64_contents", mask)))
    return out


@st.composite
def raw_contents(draw, n_inputs: int):
    kind = draw(st.sampled_from(["none", "exact", "any"]))
    if kind == "none":
        return []
    count = n_inputs if kind == "exact" else draw(st.integers(0, 4))
    out = []
    for _ in range(count):
        if draw(st.booleans()):  # well-formed BYTES elements, or int64 ids
            if draw(st.booleans()):
                items = draw(st.lists(st.binary(max_size=20), max_size=4))
                out.append(b"".join(struct.pack("<I", len(x)) + x for x in items))
            else:
                ids = draw(st.lists(st.integers(-5, 40000), max_size=8))
                out.append(np.asarray(ids, dtype="<i8").tobytes())
        else:
            out.append(draw(st.binary(max_size=64)))
    return out


def parameter(value, entry) -> None:
    if isinstance(value, bool):
        entry.bool_param = value
    elif isinstance(value, int):
        entry.int64_param = value
    elif isinstance(value, float):
        entry.double_param = value
    else:
        entry.string_param = value


params = st.dictionaries(
    st.one_of(st.sampled_from(["normalize", "truncate", "dimensions", "datatype", "binary_data_output"]),
              st.text(max_size=8)),
    st.one_of(st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1), st.floats(allow_nan=True),
              st.sampled_from(["FP16", "FP32", "INT8", ""]), st.text(max_size=8)),
    max_size=3)


@st.composite
def infer_requests(draw):
    # Mostly the served model and a proper tensor set, so that the fuzz gets past the lookup.
    # A quarter are clean requests (they must succeed, with the right rows), the rest are off in some way.
    if draw(st.integers(0, 3)) == 0:
        req = pb.ModelInferRequest(model_name=MODEL, model_version=draw(st.sampled_from(["", "1"])), id=CLEAN)
        for name, datatype, shape, (field, values) in draw(near_valid(clean=True)):
            getattr(req.inputs.add(name=name, datatype=datatype, shape=shape).contents, field).extend(values)
        return req
    usual = draw(st.integers(0, 9)) < 8
    req = pb.ModelInferRequest(model_name=MODEL if usual else draw(names),
                               model_version=draw(st.sampled_from(["", "1"]) if usual else versions),
                               id=draw(st.text(max_size=8).filter(lambda i: i != CLEAN)))
    inputs = draw(near_valid() if draw(st.integers(0, 9)) < 7 else st.lists(tensors(), max_size=3))
    for name, datatype, shape, contents in inputs:
        t = req.inputs.add(name=name, datatype=datatype, shape=shape)
        if contents is not None:
            getattr(t.contents, contents[0]).extend(contents[1])
    if not any(c is not None for *_, c in inputs) or draw(st.integers(0, 4)) == 0:
        req.raw_input_contents.extend(draw(raw_contents(len(inputs))))
    for key, value in draw(params).items():
        parameter(value, req.parameters[key])
    for out_name in draw(st.lists(st.sampled_from(["embedding", "logits", ""]), max_size=2)):
        out = req.outputs.add(name=out_name)
        for key, value in draw(params).items():
            parameter(value, out.parameters[key])
    return req


def expect_proper_status(call, request):
    try:
        return call(request, timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() not in BAD_CODES, (exc.code(), exc.details(), request)
        assert len(exc.details() or "") <= 1100
        return None


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(request=infer_requests())
def test_model_infer_never_fails_internally(stub, request):
    res = expect_proper_status(stub.ModelInfer, request)
    if request.id == CLEAN:
        assert res is not None, request  # a clean request (infer_requests' first branch) succeeds
    if res is not None:  # a success is a well-formed answer
        (out,) = res.outputs
        assert out.name == "embedding" and len(out.shape) == 2
        itemsize = 2 if out.datatype == "FP16" else 4
        assert len(res.raw_output_contents[0]) == out.shape[0] * out.shape[1] * itemsize
        rows = {len(t.contents.bytes_contents) for t in request.inputs if t.name == "text"} or {
            t.shape[0] for t in request.inputs if t.name == "input_ids"}
        assert rows == {out.shape[0]}, (rows, out.shape)


@settings(FUZZ, max_examples=EXAMPLES // 3)
@given(name=names, version=versions, params=params, ready=st.booleans())
def test_metadata_repository_and_statistics_never_fail_internally(stub, name, version, params, ready):
    expect_proper_status(stub.ModelMetadata, pb.ModelMetadataRequest(name=name, version=version))
    expect_proper_status(stub.ModelReady, pb.ModelReadyRequest(name=name, version=version))
    expect_proper_status(stub.ModelStatistics, pb.ModelStatisticsRequest(name=name, version=version))
    expect_proper_status(stub.RepositoryIndex, pb.RepositoryIndexRequest(ready=ready))
    if name != MODEL:  # loading the served model again would only cost time
        load = pb.RepositoryModelLoadRequest(model_name=name)
        for key, value in params.items():
            which = {bool: "bool_param", int: "int64_param"}.get(type(value), "string_param")
            if which == "int64_param" and not -(2 ** 63) <= value < 2 ** 63:
                continue
            setattr(load.parameters[key], which, value if which != "string_param" else str(value))
        expect_proper_status(stub.RepositoryModelLoad, load)
        expect_proper_status(stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name=name))


def test_the_server_is_healthy_and_right_after_the_fuzz(stub, bundled_worker):
    from surge.types import EmbedOptions

    assert stub.ServerLive(pb.ServerLiveRequest()).live and stub.ServerReady(pb.ServerReadyRequest()).ready
    text = "still serving after the fuzz"
    req = pb.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text.encode())
    got = np.frombuffer(stub.ModelInfer(req, timeout=60).raw_output_contents[0], dtype="<f4")
    w = bundled_worker
    want = w.finish(w.compute(w.tokenizer.encode([text])), EmbedOptions())[0]
    np.testing.assert_allclose(got, want, atol=1e-4)
