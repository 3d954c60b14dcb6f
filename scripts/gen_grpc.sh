#!/usr/bin/env bash
# Regenerates the checked-in gRPC stubs of the KServe v2 service:
#   src/surge/server/grpc/grpc_service_pb2.py and grpc_service_pb2_grpc.py
# from src/surge/server/grpc/grpc_service.proto, with grpcio-tools
# (pip install "surge[grpc-tools]"). Run from anywhere: bash scripts/gen_grpc.sh
#
# Two edits follow protoc, both so that the stubs work where surge runs:
# 1. The protobuf runtime-version guard is dropped: protoc 35 stamps "needs
#    protobuf >= 7.35" into the code although nothing in it needs more than
#    the builder API of protobuf 4.21+; pyproject allows protobuf>=4.25 (the
#    stubs were checked to import and round-trip under protobuf 4.25.9 and 7.36).
#    The gRPC stamp stays: pyproject's grpcio floor follows it.
# 2. The file goes into a private descriptor pool instead of the default one:
#    tritonclient registers Triton's messages under the same full names
#    (inference.ModelInferRequest, ...) in the default pool, and a process that
#    imports both (a test, a gateway) would otherwise fail with "duplicate symbol".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=src/surge/server/grpc
"$PY" -m grpc_tools.protoc -I src --python_out=src --grpc_python_out=src "$OUT/grpc_service.proto"
"$PY" - "$OUT/grpc_service_pb2.py" "$OUT/grpc_service_pb2_grpc.py" <<'PYEOF'
import re
import sys

pb2, pb2_grpc = sys.argv[1], sys.argv[2]
src = open(pb2).read()
src = src.replace("from google.protobuf import runtime_version as _runtime_version\n", "")
src, n = re.subn(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n", "", src)
assert n == 1, "protobuf runtime-version guard not found; check the generated code by hand"
src, n = re.subn(r"_descriptor_pool\.Default\(\)\.AddSerializedFile\(",
                 "_descriptor_pool.DescriptorPool().AddSerializedFile(", src)
assert n == 1, "AddSerializedFile call not found; check the generated code by hand"
open(pb2, "w").write(src)

src = open(pb2_grpc).read()
m = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", src)
assert m, "grpc version stamp not found"
print(f"generated with grpcio-tools {m.group(1)}")
PYEOF
echo "wrote $OUT/grpc_service_pb2.py and $OUT/grpc_service_pb2_grpc.py"
