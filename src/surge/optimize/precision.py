"""FP16 / BF16 conversion with a block list of op types kept in FP32.

The conversion works on the cleaned, unfused graph (standard ONNX ops, so
shape inference types every value) with onnxruntime's float16 converter,
which inserts the Casts at the borders of the blocked ops. BF16 is the FP16
result retyped: same borders, bfloat16 storage.

ONNX Runtime's CPU provider runs an FP16 graph, but a node without an FP16
CPU kernel is silently computed in FP32 (ORT inserts Casts around it), so such
a run hides FP16 overflow; BF16 has almost no CPU kernels. Both are therefore
validated on an *emulation*: the
same graph in FP32 with every low-precision value rounded to BF16 right where
it is produced (weights, activations, Cast borders). Compute in FP32 with
BF16 storage is also what GPU BF16 kernels do (they accumulate in FP32).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Ops whose FP16 error is large relative to their cost: normalizations
# (variance of many terms), Softmax (exp), reductions and powers.
DEFAULT_BLOCK_LIST = ["LayerNormalization", "Softmax", "ReduceMean", "ReduceSum", "Pow", "Sqrt", "Erf"]
# Op types that are never converted (integer/shape plumbing or ORT's own list).
_NEVER = {"Range", "CumSum", "TopK", "Min", "Max"}

LOW = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def float_op_types(model: onnx.ModelProto) -> list[str]:
    """Op types of the graph that compute on floats (candidates for the block list), sorted."""
    skip = {"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Reshape", "Cast", "Constant", "ConstantOfShape",
            "Equal", "Where", "And", "Not", "Slice", "Expand", "Range", "GreaterOrEqual", "Less", "Greater",
            "Flatten", "Transpose"}
    return sorted({n.op_type for n in model.graph.node} - skip - _NEVER)


def convert(model: onnx.ModelProto, precision: str, block_list: list[str], nodes=()) -> onnx.ModelProto:
    """A copy of `model` in `precision` (fp16 | bf16), `block_list` op types and the nodes named in
    `nodes` kept in FP32, FP32 inputs/outputs."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    low = convert_float_to_float16(onnx.ModelProto.FromString(model.SerializeToString()), keep_io_types=True,
                                   op_block_list=sorted(set(block_list) | _NEVER), node_block_list=list(nodes))
    if nodes:
        _unround_kept(low, model, set(nodes))
    if precision == "fp16":
        return low
    if precision == "bf16":
        return _retype(low, TensorProto.FLOAT16, TensorProto.BFLOAT16, originals=model)
    raise ValueError(f"unknown precision {precision!r}")


def _unround_kept(low: onnx.ModelProto, original: onnx.ModelProto, nodes: set[str]) -> None:
    """Keep the nodes named in `nodes` truly FP32. The converter blocks each node alone: its output
    goes through Cast(fp16) -> Cast(fp32) even when the next node is blocked too (the graph output
    as well), and its weights are stored in FP16 with a Cast to FP32 before it. Here a Cast(fp32)
    of a Cast(fp16) of a kept node's output reads that FP32 output directly (an Identity), and a
    kept node's FP16 weight is the FP32 original again. In place."""
    g = low.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    fp32 = {i.name: i for i in original.graph.initializer}

    def cast_to(n, t):
        return n.op_type == "Cast" and any(a.name == "to" and a.i == t for a in n.attribute)

    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    for n in list(g.node):
        if not cast_to(n, TensorProto.FLOAT):
            continue
        src = n.input[0]
        first = producer.get(src)
        if first is not None and cast_to(first, TensorProto.FLOAT16):
            origin = producer.get(first.input[0])
            if origin is not None and origin.name in nodes:  # a kept node's output, rounded and back
                n.op_type, n.input[0] = "Identity", first.input[0]
                del n.attribute[:]
        elif src in inits and inits[src].data_type == TensorProto.FLOAT16 and src in fp32 \
                and all(r.name in nodes for r in readers.get(n.output[0], [])):
            # a kept node's weight: the FP32 original under its own name, read through an Identity
            name = f"{src}__fp32"
            if name not in inits:
                t = onnx.TensorProto()
                t.CopyFrom(fp32[src])
                t.name = name
                g.initializer.append(t)
                inits[name] = t
            n.op_type, n.input[0] = "Identity", name
            del n.attribute[:]
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    keep = [n for n in g.node if n.op_type != "Cast" or any(o in used for o in n.output)]
    del g.node[:]
    g.node.extend(keep)
    live = {i for n in g.node for i in n.input}
    kept_inits = [i for i in g.initializer if i.name in live]
    del g.initializer[:]
    g.initializer.extend(kept_inits)


def emulate(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """An FP32 model that rounds every `precision` value where it is produced (runs on ORT CPU)."""
    low = LOW[precision]
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    types = _value_types(model)
    for init in g.initializer:
        if init.data_type == low:
            array = _to_float32(init)
            init.CopyFrom(numpy_helper.from_array(array, init.name))
    nodes = []
    for node in g.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.t.data_type == low:
                    attr.t.CopyFrom(numpy_helper.from_array(_to_float32(attr.t), attr.t.name))
        for attr in node.attribute:
            if node.op_type in ("Cast", "CastLike") and attr.name == "to" and attr.i == low:
                attr.i = TensorProto.FLOAT
            if node.op_type == "ConstantOfShape" and attr.name == "value" and attr.t.data_type == low:
                attr.t.CopyFrom(numpy_helper.from_array(_to_float32(attr.t), attr.t.name))
        nodes.append(node)
        for i, out in enumerate(node.output):
            if out and types.get(out) == low:
                raw = f"{out}__emu_raw"
                node.output[i] = raw
                nodes.append(helper.make_node("Cast", [raw], [f"{out}__emu_low"], to=low, name=f"{raw}_to_low"))
                nodes.append(helper.make_node("Cast", [f"{out}__emu_low"], [out], to=TensorProto.FLOAT,
                                              name=f"{raw}_to_f32"))
    del g.node[:]
    g.node.extend(nodes)
    for vi in list(g.value_info):
        if vi.type.tensor_type.elem_type == low:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    return model


def blocked_nodes_ok(model: onnx.ModelProto, block_list: list[str]) -> list[str]:
    """Names of blocked-type nodes that read or write a non-FP32 float (empty when the block list holds)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    del model.graph.value_info[:]  # infer afresh rather than trust what the converter left
    model = onnx.shape_inference.infer_shapes(model)
    types = _value_types(model)
    bad = []
    for node in model.graph.node:
        if node.op_type in block_list:
            for name in [*node.input, *node.output]:
                if name and types.get(name) in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
                    bad.append(node.name)
                    break
    return bad


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.value_info, *g.input, *g.output]}
    types.update({t.name: t.data_type for t in g.initializer})
    for node in g.node:
        if node.op_type == "Cast":
            to = next(a.i for a in node.attribute if a.name == "to")
            types[node.output[0]] = to
        if node.op_type == "Constant":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


def _to_float32(tensor: onnx.TensorProto) -> np.ndarray:
    if tensor.data_type == TensorProto.BFLOAT16:
        raw = np.frombuffer(tensor.raw_data, np.uint16) if tensor.raw_data else np.asarray(tensor.int32_data, np.uint16)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(tuple(tensor.dims))
    return numpy_helper.to_array(tensor).astype(np.float32)


def _to_bf16(array: np.ndarray, name: str) -> onnx.TensorProto:
    """Round-to-nearest-even FP32 -> BF16."""
    bits = np.ascontiguousarray(array, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    tensor = TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(array.shape))
    tensor.raw_data = rounded.tobytes()
    return tensor


def _retype(model: onnx.ModelProto, src: int, dst: int, originals: onnx.ModelProto) -> onnx.ModelProto:
    """FP16 -> BF16 everywhere; initializers re-rounded from the FP32 originals (no double rounding)."""
    fp32 = {t.name: t for t in originals.graph.initializer}
    g = model.graph
    for i, init in enumerate(g.initializer):
        if init.data_type == src:
            source = fp32.get(init.name)
            array = numpy_helper.to_array(source).astype(np.float32) if source is not None and source.data_type == TensorProto.FLOAT \
                else numpy_helper.to_array(init).astype(np.float32)
            g.initializer[i].CopyFrom(_to_bf16(array, init.name))
    for node in g.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.i == src:
                attr.i = dst
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == src:
                attr.t.CopyFrom(_to_bf16(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
    for vi in [*g.value_info, *g.input, *g.output]:
        if vi.type.tensor_type.elem_type == src:
            vi.type.tensor_type.elem_type = dst
    return model
