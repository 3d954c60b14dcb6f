"""Exact INT8 products on every x86 CPU: int8 weights become uint8 where ONNX Runtime's u8 x s8 kernel saturates.

ONNX Runtime's MLAS runs a uint8-activation x int8-weight product (MatMulInteger,
MatMulIntegerToFloat, DynamicQuantizeMatMul, QAttention's projection) with VPDPBUSD on CPUs that have
AVX-VNNI or AVX512-VNNI (and with AMX tiles where present): exact 32-bit sums. On
x86 CPUs without them (AMD Zen 1-3, Intel before Cascade Lake) it uses VPMADDUBSW,
which adds each pair of u8*s8 products into a *saturating* int16: 2 * 255 * 127 >
32,767. surge's per-row activations sit around the zero point 128 and use the whole
byte, so there most products are wrong: measured on an AMD EPYC (Zen 3, AVX2), 99.9%
of a [1024, 384] x [384, 1536] product's outputs wrong on full-range codes, and the
bundled model's INT8 artifact at held-out top-1 0.977 instead of 0.985.

The same product with the weights stored as uint8 (w + 128, zero point + 128) takes
MLAS's u8 x u8 kernel, which widens to int16 before VPMADDWD and is exact everywhere
(slower than the saturating one, faster than FP32: benchmarks/int8_weights.py,
docs/benchmarks/optimizer.md, issue 21, session 9).
The rewrite is exact arithmetic (same integers, same scales), so the artifact keeps its
int8 weights and its gate numbers; the engines apply it when the session is made, on
the CPUs that need it.

SURGE_INT8_WEIGHTS: auto (default: widen where the CPU saturates), u8 (always), s8 (never).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np

# Ops whose input 1 is the weight: where the weight's zero point sits, and A's (None: A is float,
# quantized to uint8 by the op itself).
_WEIGHT_ZP = {("MatMulIntegerToFloat", "com.microsoft"): (5, 4), ("DynamicQuantizeMatMul", "com.microsoft"): (3, None),
              ("MatMulInteger", ""): (3, 2), ("QAttention", "com.microsoft"): (7, 6)}
# CPU flags (Linux /proc/cpuinfo names) with which MLAS's u8 x s8 product does not saturate.
_EXACT_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def u8s8_saturates(machine: str | None = None, flags: set[str] | None = None) -> bool:
    """True when ONNX Runtime's u8 x s8 product may saturate on this CPU: x86 without AVX-VNNI,
    AVX512-VNNI or AMX-INT8. An x86 CPU whose flags cannot be read counts as saturating (the
    widened product is exact everywhere, only slower); other architectures (ARM: SDOT/UDOT) do not."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return False
    flags = _cpu_flags() if flags is None else flags
    return flags is None or not (flags & _EXACT_FLAGS)


def should_widen() -> bool:
    """SURGE_INT8_WEIGHTS (auto | u8 | s8) against this CPU."""
    mode = os.environ.get("SURGE_INT8_WEIGHTS", "auto").strip().lower()
    if mode not in ("auto", "u8", "s8"):
        from surge.errors import ConfigError
        raise ConfigError(f"SURGE_INT8_WEIGHTS must be auto, u8 or s8, not '{mode}'", param="SURGE_INT8_WEIGHTS")
    return mode == "u8" or (mode == "auto" and u8s8_saturates())


def widen_int8_weights(model) -> int:
    """Rewrite, in place, every int8 weight initializer of a uint8-activation integer product to
    uint8 (w + 128) with its zero point + 128 (uint8; a missing one becomes 128). Returns how many
    nodes changed. Shared initializers are converted once; a weight that is not a constant
    initializer (or a zero point that is not), or an activation not known to be uint8 (from its
    zero point, its declared type or its producer), leaves its node as it is."""
    from onnx import TensorProto
    from onnx import numpy_helper as nh

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    widened: dict[str, str] = {}

    def to_u8(name: str, default_zero: bool = False) -> str | None:
        if name in widened:
            return widened[name]
        if default_zero:
            arr = np.zeros((), np.int8)
        else:
            init = inits.get(name)
            if init is None or init.data_type != TensorProto.INT8:
                return None
            arr = nh.to_array(init)
        new = f"{name or 'zero_point'}/u8"
        graph.initializer.append(nh.from_array((arr.astype(np.int16) + 128).astype(np.uint8), new))
        widened[name] = new
        return new

    typed = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info)}
    producers = {o: n for n in graph.node for o in n.output}

    def dtype(name: str) -> int | None:
        """A tensor's element type from its initializer, its declared type or its producer."""
        if name in inits:
            return inits[name].data_type
        if name in typed:
            return typed[name]
        prod = producers.get(name)
        if prod is None:
            return None
        if prod.op_type == "DynamicQuantizeLinear":  # y and y_zero_point are uint8, y_scale float
            return TensorProto.FLOAT if name == prod.output[1] else TensorProto.UINT8
        if prod.op_type == "Cast":
            return next((a.i for a in prod.attribute if a.name == "to"), None)
        if prod.op_type == "QuantizeLinear":
            return dtype(prod.input[2]) if len(prod.input) > 2 and prod.input[2] else TensorProto.UINT8
        return None

    def a_is_uint8(node, zp_at: int | None) -> bool:
        """Only u8 x s8 saturates (and an int8 A with uint8 weights is not a kernel ORT has)."""
        if zp_at is None:  # A is float; the op quantizes it to uint8
            return True
        has_zp = len(node.input) > zp_at and node.input[zp_at]
        return dtype(node.input[zp_at] if has_zp else node.input[0]) == TensorProto.UINT8

    changed = 0
    for node in graph.node:
        where = _WEIGHT_ZP.get((node.op_type, node.domain or ""))
        if where is None or len(node.input) < 2 or not a_is_uint8(node, where[1]):
            continue
        zp_at = where[0]
        has_zp = len(node.input) > zp_at and node.input[zp_at]
        zp = inits.get(node.input[zp_at]) if has_zp else None
        if (has_zp and (zp is None or zp.data_type != TensorProto.INT8)) or \
                inits.get(node.input[1]) is None or inits[node.input[1]].data_type != TensorProto.INT8:
            continue
        w_new = to_u8(node.input[1])
        zp_new = to_u8(node.input[zp_at]) if has_zp else to_u8("", default_zero=True)
        node.input[1] = w_new
        while len(node.input) <= zp_at:
            node.input.append("")
        node.input[zp_at] = zp_new
        changed += 1
    if changed:  # drop the int8 originals nothing reads any more
        from surge.engines.onnx_proto import drop_initializers

        used = {i for n in graph.node for i in n.input}
        dropped = {name for name in widened if name not in used}
        drop_initializers(graph, lambda init: init.name in dropped)
        # graphs older than IR 4 list initializers among the inputs too: a dropped one must go
        # there as well, or the session would ask to be fed it
        inputs = [i for i in graph.input if i.name not in dropped]
        del graph.input[:]
        graph.input.extend(inputs)
    return changed


def prepared(model: str | Path | bytes) -> str | bytes:
    """What to hand onnxruntime.InferenceSession: `model` itself, or (where should_widen() and
    the graph has int8 weights) the serialized graph with its weights widened."""
    if not should_widen():
        return model if isinstance(model, bytes) else str(model)
    import onnx

    data = model if isinstance(model, bytes) else None
    if data is None and Path(model).stat().st_size < 2**31:
        data = Path(model).read_bytes()
    # op types are plain strings in the protobuf: most graphs (FP32 ones) end here unparsed
    if data is not None and b"MatMulInteger" not in data and b"DynamicQuantizeMatMul" not in data:
        return model if isinstance(model, bytes) else str(model)
    # a path's external data (and a graph over 2 GB) load relative to the file
    proto = onnx.ModelProto.FromString(data) if isinstance(model, bytes) else onnx.load(str(model))
    if not widen_int8_weights(proto):
        return model if isinstance(model, bytes) else str(model)
    return proto.SerializeToString()
