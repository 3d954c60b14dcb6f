"""The checked-in gRPC stubs: Triton-compatible on the wire, importable next to
tritonclient, within pyproject's version floors, and reproducible by
scripts/gen_grpc.sh."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from surge.server.grpc import grpc_service_pb2 as ours
from surge.server.grpc import grpc_service_pb2_grpc as ours_grpc

ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = ROOT / "src" / "surge" / "server" / "grpc"


def _triton():
    return pytest.importorskip("tritonclient.grpc.service_pb2")


# What Triton's proto gained after the oldest tritonclient the test extras can resolve: pip picks
# tritonclient 2.41 beside protobuf 7 (the checked-in stubs' gencode; newer tritonclients pin protobuf 6),
# and 2.41's proto predates per-response statistics. An older client skips these fields on the wire.
NEWER_THAN_OLDEST_CLIENT = {"InferResponseStatistics", "ModelStatistics.response_stats",
                            "ModelStatistics.ResponseStatsEntry"}


def test_every_message_matches_triton_field_by_field():
    triton = _triton()
    absent: set[str] = set()

    def check(ours_desc, theirs_desc, path):
        assert ours_desc.full_name == theirs_desc.full_name
        theirs_fields = {f.number: f for f in theirs_desc.fields}
        for f in ours_desc.fields:
            t = theirs_fields.get(f.number)
            if t is None:
                absent.add(f"{path}.{f.name}")
                continue
            assert (f.name, f.type, f.is_repeated) == (t.name, t.type, t.is_repeated), f"{ours_desc.full_name}.{f.name}"
            if f.message_type is not None:
                assert f.message_type.full_name == t.message_type.full_name
        for nested in ours_desc.nested_types:
            if nested.name not in theirs_desc.nested_types_by_name:
                absent.add(f"{path}.{nested.name}")
                continue
            check(nested, theirs_desc.nested_types_by_name[nested.name], f"{path}.{nested.name}")

    assert ours.DESCRIPTOR.package == "inference"
    # Triton keeps the model configuration messages in model_config.proto (same package).
    config = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    theirs_messages = {**config.DESCRIPTOR.message_types_by_name, **triton.DESCRIPTOR.message_types_by_name}
    for name, desc in ours.DESCRIPTOR.message_types_by_name.items():
        if name not in theirs_messages:
            absent.add(name)
            continue
        check(desc, theirs_messages[name], name)
    # Anything of ours the installed client lacks must be one of Triton's later additions, no invention.
    assert absent <= NEWER_THAN_OLDEST_CLIENT, absent - NEWER_THAN_OLDEST_CLIENT
    for name, enum in ours.DESCRIPTOR.enum_types_by_name.items():
        theirs_enum = config.DESCRIPTOR.enum_types_by_name[name]
        assert {(v.name, v.number) for v in enum.values} <= {(v.name, v.number) for v in theirs_enum.values}
    service = ours.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for m in service.methods:
        t = theirs.methods_by_name[m.name]
        assert (m.input_type.full_name, m.output_type.full_name) == (t.input_type.full_name, t.output_type.full_name)


def test_wire_compatible_both_ways_in_one_process():
    triton = _triton()
    req = ours.ModelInferRequest(model_name="m", model_version="2", id="x")
    t = req.inputs.add(name="input_ids", datatype="INT64", shape=[1, 3])
    t.parameters["binary_data_size"].int64_param = 24
    req.outputs.add(name="embedding").parameters["datatype"].string_param = "FP16"
    req.parameters["normalize"].bool_param = False
    req.raw_input_contents.append(b"\x01" * 24)
    theirs = triton.ModelInferRequest.FromString(req.SerializeToString())
    assert theirs.SerializeToString(deterministic=True) == req.SerializeToString(deterministic=True)
    assert theirs.outputs[0].parameters["datatype"].string_param == "FP16"
    resp = triton.ModelInferResponse(model_name="m")
    resp.outputs.add(name="embedding", datatype="FP32", shape=[1, 4])
    resp.raw_output_contents.append(b"\x00" * 16)
    back = ours.ModelInferResponse.FromString(resp.SerializeToString())
    assert list(back.outputs[0].shape) == [1, 4] and back.raw_output_contents[0] == b"\x00" * 16


def test_stubs_need_no_newer_runtime_than_pyproject_allows():
    source = (STUB_DIR / "grpc_service_pb2.py").read_text()
    # No protobuf runtime-version guard (pyproject allows protobuf>=4.25) and a private pool.
    assert "ValidateProtobufRuntimeVersion" not in source
    assert "_descriptor_pool.Default()" not in source
    stamp = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (STUB_DIR / "grpc_service_pb2_grpc.py").read_text())
    floor = re.search(r'"grpcio>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(floor.group(1)) >= as_tuple(stamp.group(1)), "raise pyproject's grpcio floor to the stubs' stamp"
    assert callable(ours_grpc.add_GRPCInferenceServiceServicer_to_server)


def test_gen_script_reproduces_checked_in_stubs(tmp_path):
    pytest.importorskip("grpc_tools")
    from importlib.metadata import version

    stamp = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (STUB_DIR / "grpc_service_pb2_grpc.py").read_text())
    installed = version("grpcio-tools")
    # Another minor release may write other code; a patch release writes the same code under its own stamp
    # (pyproject leaves grpcio-tools unpinned, so an exact match skipped this test wherever pip took a newer patch).
    if installed.split(".")[:2] != stamp.group(1).split(".")[:2]:
        pytest.skip(f"grpcio-tools {installed} installed; the stubs come from {stamp.group(1)}")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gen_grpc.sh", tmp_path / "scripts")
    out = tmp_path / "src" / "surge" / "server" / "grpc"
    out.mkdir(parents=True)
    shutil.copy(STUB_DIR / "grpc_service.proto", out)
    subprocess.run(["bash", str(tmp_path / "scripts" / "gen_grpc.sh")], check=True, capture_output=True)
    for name in ("grpc_service_pb2.py", "grpc_service_pb2_grpc.py"):
        got = (out / name).read_text().replace(f"GRPC_GENERATED_VERSION = '{installed}'",
                                               f"GRPC_GENERATED_VERSION = '{stamp.group(1)}'")
        assert got == (STUB_DIR / name).read_text(), f"{name} is stale: run scripts/gen_grpc.sh"
