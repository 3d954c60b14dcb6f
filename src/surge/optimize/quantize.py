"""INT8 dynamic quantization for the CPU with onnxruntime.quantization.

Weights are stored as int8 (per tensor, or per output channel); activations
are quantized on the fly per batch. MatMul becomes MatMulInteger (which ONNX
Runtime fuses into DynamicQuantizeMatMul when it loads the model) and a fused
Attention becomes QAttention, so the packed QKV projection of every layer runs
in int8 too. Only MatMul / Attention / Gemm are quantized: the embedding
tables (EmbedLayerNormalization's Gather) stay FP32, since a lookup costs no
arithmetic and INT8 there would only add rounding.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx

QUANTIZED_OPS = ["MatMul", "Attention", "Gemm"]


def quantize_int8(model: onnx.ModelProto, per_channel: bool = False,
                  exclude: list[str] | tuple[str, ...] = ()) -> tuple[onnx.ModelProto, dict]:
    """The quantized model and what was done (for the manifest). `exclude`: node names kept in FP32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    before = _ops(model)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save(model, str(src))
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # the quantizer logs per-tensor notes on the root logger
        try:
            quantize_dynamic(str(src), str(dst), per_channel=per_channel, weight_type=QuantType.QInt8,
                             op_types_to_quantize=QUANTIZED_OPS, nodes_to_exclude=list(exclude),
                             # Only MatMuls with a constant weight: activations x activations
                             # (the unfused attention scores) stay in float.
                             extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
        finally:
            root.setLevel(level)
        out = onnx.load(str(dst))
    after = _ops(out)
    quantized = {op: before.get(op, 0) - after.get(op, 0) for op in QUANTIZED_OPS if before.get(op, 0) > after.get(op, 0)}
    return out, {"method": "dynamic", "weight_type": "int8", "activation_type": "uint8 (per tensor, per batch)",
                 "per_channel": per_channel, "quantized_ops": quantized, "kept_fp32": sorted(exclude),
                 "int8_ops": {k: v for k, v in after.items() if k in ("QAttention", "MatMulInteger",
                                                                       "DynamicQuantizeMatMul", "DynamicQuantizeLinear")}}


def _ops(model: onnx.ModelProto) -> dict:
    counts: dict = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
