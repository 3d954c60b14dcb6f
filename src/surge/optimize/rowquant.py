"""Batch-invariant INT8: weights per output channel, activations per row (per token).

ONNX Runtime's dynamic quantization (quantize.py) picks one activation scale
per MatMul input *tensor*, i.e. over the whole padded batch: a sentence's
vector then depends on the longest, loudest neighbour in its batch (measured
on the bundled MiniLM: cosine down to 0.988 between a sentence alone and the
same sentence beside a long one), and the result cache keeps whichever
variant it saw first. Here every token row gets its own scale, computed from
that row alone, so a row's int8 codes — and the sentence's vector — are the
same whatever else shares the batch and however much padding it carries.
Per-token activation scales are also the finer grid: on the held-out queries
mean cosine rose from 0.9920 to 0.9984 and the worst sentence from 0.950 to
0.987 (docs/benchmarks/optimizer.md).

Per weighted node (x is [..., K], W a constant [K, N]):

    m      = max(ReduceMax(x), -ReduceMin(x))          per row, [..., 1]
    q      = QuantizeLinear(x as [T, K], m/127 as [T], zero point 128, axis=0)   uint8
    y      = MatMulIntegerToFloat(q, Wq, m/127, w_scale[N], 128, 0)             com.microsoft

Inputs that are GELU outputs (the FFN down-projections) are bounded below by
GELU's minimum (-0.17): rows are shifted by that bound (x + c >= 0, c per
input channel after smoothing) and quantized *unsigned* over [0, max], twice
the resolution of the symmetric grid, which spends half its codes on
negatives that GELU never produces; the shift's product c @ W is a constant
vector subtracted after the MatMul. Measured on the held-out queries (GPTQ
weights, alpha 0.65): docs/benchmarks/optimizer.md, Issue 21, session 2.

ReduceMax/ReduceMin read x without writing a temporary, and the per-axis
QuantizeLinear does scale, round, shift and saturate in one pass (ONNX Runtime
1.32 refuses a per-row *zero point* in MatMulIntegerToFloat, so rows are
symmetric around 128). A fused com.microsoft Attention becomes the same
row-quantized projection to packed QKV, a Split, and MultiHeadAttention (its
CPU kernel has no packed-QKV layout), with the QKV bias and the padding mask
passed through unchanged.

Two variants, per node:

* outlier split (`outliers=`, chosen by outlier_channels): a few input channels
  of largest calibration |x| leave the int8 product (masked in the smoothing
  Mul in front, or by a Mul of their own) and are computed in FP32 (Gather,
  a K=k product accumulated onto the int8 one by a Gemm), so the row scale no longer follows
  them. Batch invariant as well. On the bundled MiniLM, 4 channels a node took
  held-out strict top-1 from 0.973 to 0.985 with no node left in FP32.
* static grid (`static=`, activation_ranges): one calibrated affine uint8 grid
  per node input, a single QuantizeLinear instead of the per-row chain. Batch
  invariant, faster, and far coarser (held-out top-1 0.930).
Both measured in docs/benchmarks/optimizer.md, issue 21 session 7
(benchmarks/int8_designs.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from onnx import numpy_helper as nh

from surge.engines.onnx_proto import copy_model, drop_initializers

_C = "rowq_const_"  # shared constants
GELU_MIN = 0.17  # -min over x of x * Phi(x) is 0.16997: a lower bound of every (Bias/Fast)Gelu output
GELU_OPS = {"Gelu", "BiasGelu", "FastGelu"}


def quantizable(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """MatMul nodes with a constant 2-D weight and plain fused Attention nodes: what quantize_rows converts."""
    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if len(n.input) < 2 or n.input[1] not in inits or len(inits[n.input[1]].dims) != 2:
            continue
        if n.op_type == "MatMul" and n.domain in ("", "ai.onnx"):
            out.append(n)
        elif n.op_type == "Attention" and n.domain == "com.microsoft" and _plain_attention(n, inits):
            out.append(n)
    return out


def _plain_attention(n: onnx.NodeProto, inits: dict) -> bool:
    # Only the encoder form the passes produce: packed equal-width QKV, a constant
    # bias, a padding mask, no past state, no causal masking.
    attrs = {a.name for a in n.attribute}
    return (attrs <= {"num_heads", "scale", "mask_filter_value"} and 3 <= len(n.input) <= 4
            and n.input[2] in inits and inits[n.input[1]].dims[1] % 3 == 0)


def _weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = np.maximum(np.abs(w).max(0), 1e-12) / 127.0
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


def quantize_rows(model: onnx.ModelProto, exclude: list[str] | tuple[str, ...] = (),
                  weights: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                  unsigned_gelu: bool = True,
                  static: dict[str, tuple[float, float]] | None = None,
                  outliers: dict[str, np.ndarray] | None = None) -> tuple[onnx.ModelProto, dict]:
    """The per-row INT8 model and what was done (for the manifest). `exclude`: node names kept in FP32;
    `weights`: node name -> (int8 codes [K, N], scale [N]) already chosen (gptq.py), else rounded here;
    `unsigned_gelu`: GELU-fed inputs shifted and quantized unsigned (False: symmetric like the others);
    `static`: node name -> (min, max) of its input (activation_ranges): that node's activations on one fixed
    affine uint8 grid (a single QuantizeLinear, no per-row reductions; batch invariant too, and coarser);
    `outliers`: node name -> input channels (outlier_channels) whose part of the product runs in FP32, the
    int8 product reading the other channels only (pass `weights` rounded for that split, gptq_weights)."""
    targets = {n.name for n in quantizable(model) if n.name and n.name not in exclude}
    source = {i.name: i for i in model.graph.initializer}
    # The FP32 weights of the nodes converted here are read from `model` and never copied: a whole copy
    # of the graph cost ~2/3 of this function (the fallback search converts the model once a step).
    converted = {n.input[1] for n in model.graph.node if n.name in targets and len(n.input) > 1}
    kept_reads = {i for n in model.graph.node if n.name not in targets for i in n.input} | \
        {o.name for o in model.graph.output}
    out = copy_model(model, skip_initializers=converted - kept_reads)
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    graph.initializer.extend([
        nh.from_array(np.array([-1], np.int64), _C + "last_axis"),
        nh.from_array(np.array(1e-8, np.float32), _C + "eps"),
        nh.from_array(np.array(1 / 127.0, np.float32), _C + "inv127"),
        nh.from_array(np.array(128, np.uint8), _C + "zp"),
        nh.from_array(np.array(0, np.uint8), _C + "zp0"),
        nh.from_array(np.array(1 / 255.0, np.float32), _C + "inv255"),
        nh.from_array(np.array(0, np.int8), _C + "wzp"),
        nh.from_array(np.array([-1], np.int64), _C + "flat"),
    ])
    nodes: list[onnx.NodeProto] = []
    counts = {"MatMul": 0, "Attention": 0}
    for node in graph.node:
        if node.name not in targets:
            nodes.append(node)
            continue
        p = f"rowq/{node.name}"
        w = nh.to_array(source[node.input[1]]).astype(np.float32)
        # before any outlier mask is folded into a smoothing Mul (the shift reads that Mul's factor)
        shift = _gelu_shift(graph, node.input[0], w.shape[0], inits) if node.op_type == "MatMul" and unsigned_gelu else None
        split = outliers.get(node.name) if outliers is not None else None
        pre: list[onnx.NodeProto] = []
        x_in = node.input[0]
        if split is not None and len(split):
            mask = np.ones(w.shape[0], np.float32)
            mask[split] = 0.0
            pre, x_in = _split_outliers(graph, inits, p, x_in, w, np.asarray(split, np.int64), mask)
            w = w * mask[:, None]
            shift = None if shift is None else shift * mask  # the zeroed channels need no shift
            counts["outlier_nodes"] = counts.get("outlier_nodes", 0) + 1
        wq, ws = weights[node.name] if weights and node.name in weights else _weight(w)
        graph.initializer.extend([nh.from_array(wq, p + "/wq"), nh.from_array(ws, p + "/ws"),
                                  nh.from_array(np.array([-1, w.shape[0]], np.int64), p + "/rows_k")])
        if static and node.name in static:
            scale, zp = static_grid(*static[node.name])
            graph.initializer.extend([nh.from_array(np.array(scale, np.float32), p + "/scale"),
                                      nh.from_array(np.array(zp, np.uint8), p + "/zp")])
            chain = [helper.make_node("QuantizeLinear", [x_in, p + "/scale", p + "/zp"], [p + "/q"])]
            counts["static"] = counts.get("static", 0) + 1
            if node.op_type == "MatMul":
                new = chain + [_mmitf(p, node.output[0], zp=p + "/zp")]
            else:
                new = chain + _attention_tail(p, node, zp=p + "/zp")
        elif shift is not None:
            wd = wq.astype(np.float32) * ws  # the weights the int8 product really uses
            graph.initializer.extend([nh.from_array(shift, p + "/shift"),
                                      nh.from_array((shift.astype(np.float64) @ wd).astype(np.float32), p + "/shift_w")])
            new = _row_quantize_unsigned(p, x_in)
            new += [_mmitf(p, p + "/shifted_out", zp=_C + "zp0"),
                    helper.make_node("Sub", [p + "/shifted_out", p + "/shift_w"], [node.output[0]])]
            counts["unsigned"] = counts.get("unsigned", 0) + 1
        elif node.op_type == "MatMul":
            new = _row_quantize(p, x_in) + [_mmitf(p, node.output[0])]
        else:
            new = _row_quantize(p, x_in) + _attention_tail(p, node)
        if pre:
            new = pre + _add_outliers(new, p, node.output[0] if node.op_type == "MatMul" else p + "/qkv")
        for i, n in enumerate(new):
            n.name = f"{p}/{i}"
        nodes += new
        counts[node.op_type] += 1
    del graph.node[:]
    graph.node.extend(nodes)
    for opset in out.opset_import:  # Split's num_outputs, per-axis QuantizeLinear: opset 18
        if opset.domain in ("", "ai.onnx") and opset.version < 18:
            opset.version = 18
    if not any(o.domain == "com.microsoft" for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _prune_unused(out)
    static_nodes = counts.get("static", 0)
    method = "per-row" if not static_nodes else "static" if static_nodes == counts["MatMul"] + counts["Attention"] \
        else "per-row + static"
    info = {"method": method, "weight_type": "int8 (symmetric, per output channel)",
            "activation_type": "uint8 (symmetric around 128, one scale per token row, computed from that row)",
            "batch_invariant": True, "per_channel": True,
            "quantized_ops": {k: counts[k] for k in ("MatMul", "Attention") if counts[k]},
            "static_activation_nodes": static_nodes,
            "outlier_channels": {"nodes": counts.get("outlier_nodes", 0),
                                 "per_node": sorted({len(v) for v in (outliers or {}).values()}),
                                 "computed_in": "fp32"} if counts.get("outlier_nodes") else None,
            "unsigned_gelu_inputs": counts.get("unsigned", 0),
            "kept_fp32": sorted(exclude)}
    return out, info


def outlier_channels(model: onnx.ModelProto, absmax: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """The k input channels of largest calibration |x| of each quantizable node (absmax: activation_absmax of
    this model), sorted: the `outliers` argument of quantize_rows and gptq_weights."""
    return {n.name: np.sort(np.argsort(-absmax[n.input[0]], kind="stable")[:k]).astype(np.int64)
            for n in quantizable(model) if n.input[0] in absmax and k > 0}


def activation_ranges(model: onnx.ModelProto, batches, threads: int = 0,
                      outliers: dict[str, np.ndarray] | None = None) -> dict[str, tuple[float, float]]:
    """(min, max) of every quantizable node's input over the real tokens of the batches (padding left out:
    a static grid is fixed, so padded rows need no room in it): the `static` argument of quantize_rows.
    `outliers` (outlier_channels): those channels of a node leave its int8 product, so its grid covers the
    other channels only (and 0, what the masked channels read)."""
    from surge.optimize.smooth import probe_inputs

    nodes = quantizable(model)
    lo: dict[str, np.ndarray] = {}
    hi: dict[str, np.ndarray] = {}
    for b, values in probe_inputs(model, sorted({n.input[0] for n in nodes}), batches, threads):
        real = b.attention_mask.astype(bool)
        for name, v in values.items():
            x = v[real]  # [tokens, channels]
            lo[name] = np.minimum(lo.get(name, 0.0), x.min(0))
            hi[name] = np.maximum(hi.get(name, 0.0), x.max(0))
    out = {}
    for n in nodes:
        keep = np.ones(lo[n.input[0]].shape[0], bool)
        if outliers is not None and n.name in outliers:
            keep[np.asarray(outliers[n.name], np.int64)] = False
        out[n.name] = (float(lo[n.input[0]][keep].min(initial=0.0)), float(hi[n.input[0]][keep].max(initial=0.0)))
    return out


def static_grid(lo: float, hi: float) -> tuple[float, int]:
    """Scale and uint8 zero point of the affine grid that covers [lo, hi] (0 always representable)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = max(hi - lo, 1e-8) / 255.0
    return scale, int(np.clip(np.round(-lo / scale), 0, 255))


def _attention_tail(p: str, node: onnx.NodeProto, zp: str = _C + "zp") -> list[onnx.NodeProto]:
    heads = next(a.i for a in node.attribute if a.name == "num_heads")
    extra = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in ("scale", "mask_filter_value")}
    return [_mmitf(p, p + "/qkv", zp=zp),
            helper.make_node("Split", [p + "/qkv"], [p + "/query", p + "/key", p + "/value"], axis=-1, num_outputs=3),
            helper.make_node("MultiHeadAttention", [p + "/query", p + "/key", p + "/value", node.input[2],
                                                    node.input[3] if len(node.input) > 3 else ""],
                             [node.output[0]], domain="com.microsoft", num_heads=heads, **extra)]


def _row_quantize(p: str, x: str) -> list[onnx.NodeProto]:
    return [
        helper.make_node("ReduceMax", [x, _C + "last_axis"], [p + "/max"], keepdims=1),
        helper.make_node("ReduceMin", [x, _C + "last_axis"], [p + "/min"], keepdims=1),
        helper.make_node("Neg", [p + "/min"], [p + "/neg_min"]),
        helper.make_node("Max", [p + "/max", p + "/neg_min", _C + "eps"], [p + "/absmax"]),
        helper.make_node("Mul", [p + "/absmax", _C + "inv127"], [p + "/scale"]),  # [..., 1]
        helper.make_node("Reshape", [p + "/scale", _C + "flat"], [p + "/scale_rows"]),  # [T]
        helper.make_node("Shape", [p + "/scale_rows"], [p + "/rows"]),
        helper.make_node("Expand", [_C + "zp", p + "/rows"], [p + "/zp_rows"]),
        helper.make_node("Shape", [x], [p + "/x_shape"]),
        helper.make_node("Reshape", [x, p + "/rows_k"], [p + "/x_rows"]),  # [T, K]
        helper.make_node("QuantizeLinear", [p + "/x_rows", p + "/scale_rows", p + "/zp_rows"], [p + "/q_rows"], axis=0),
        helper.make_node("Reshape", [p + "/q_rows", p + "/x_shape"], [p + "/q"]),
    ]


def _split_outliers(graph: onnx.GraphProto, inits: dict, p: str, x: str, w: np.ndarray, split: np.ndarray,
                    mask: np.ndarray) -> tuple[list[onnx.NodeProto], str]:
    """Nodes gathering the `split` input channels (p/x_out, whose FP32 product _add_outliers adds), and the tensor the
    int8 product then reads (x with those channels zeroed)."""
    w_out = w[split]
    smoothing = _own_smoothing(graph, x, w.shape[0], inits)
    if smoothing is not None:
        # The mask goes into the smoothing Mul in front (no extra pass over x): the outlier channels
        # are gathered from that Mul's input, and their weight rows take its factor instead.
        mul, inv = smoothing
        inits[mul.input[1]].CopyFrom(nh.from_array(inv * mask, mul.input[1]))
        w_out = w_out * inv[split, None]
        pre = [helper.make_node("Gather", [mul.input[0], p + "/outl"], [p + "/x_out"], axis=-1)]
    else:
        graph.initializer.append(nh.from_array(mask, p + "/keep"))
        pre = [helper.make_node("Mul", [x, p + "/keep"], [p + "/x_main"]),
               helper.make_node("Gather", [x, p + "/outl"], [p + "/x_out"], axis=-1)]
        x = p + "/x_main"
    graph.initializer.extend([nh.from_array(split, p + "/outl"), nh.from_array(w_out.astype(np.float32), p + "/w_out"),
                              nh.from_array(np.array([-1, len(split)], np.int64), p + "/outl_rows"),
                              nh.from_array(np.array([-1, w.shape[1]], np.int64), p + "/y_rows")])
    return pre, x


def _add_outliers(new: list[onnx.NodeProto], p: str, final: str) -> list[onnx.NodeProto]:
    """`new` with the node that wrote `final` writing p/y_main instead, followed by
    final = x_out @ w_out + y_main as one Gemm (y_main its C operand)."""
    # A MatMul then an Add would pass over the [T, N] output twice; Gemm accumulates the K = k
    # product onto C in one pass (-7.5% of the whole INT8 run at 24-query batches: docs/benchmarks/
    # optimizer.md, session 8). Gemm is 2-D: rows are flattened (Reshape aliases, no copy) and the
    # product's shape restored.
    for k, n in enumerate(new):
        if final in n.output:
            n.output[list(n.output).index(final)] = p + "/y_main"
            tail = [helper.make_node("Reshape", [p + "/x_out", p + "/outl_rows"], [p + "/x_out_rows"]),
                    helper.make_node("Reshape", [p + "/y_main", p + "/y_rows"], [p + "/y_main_rows"]),
                    helper.make_node("Shape", [p + "/y_main"], [p + "/y_shape"]),
                    helper.make_node("Gemm", [p + "/x_out_rows", p + "/w_out", p + "/y_main_rows"], [p + "/y_sum_rows"]),
                    helper.make_node("Reshape", [p + "/y_sum_rows", p + "/y_shape"], [final])]
            return new[:k + 1] + tail + new[k + 1:]
    raise ValueError(f"{final} is not written by the quantized nodes of {p}")


def _own_smoothing(graph: onnx.GraphProto, x: str, k: int, inits: dict):
    """(the Mul, its [K] factor) when x is the output of a Mul by a constant vector, that Mul and its
    constant each read by nothing else (so changing the constant changes only this product), else None."""
    producer = next((n for n in graph.node if x in n.output), None)
    if producer is None or producer.op_type != "Mul" or len(producer.input) != 2 or producer.input[1] not in inits:
        return None
    readers = [i for n in graph.node for i in n.input]
    if readers.count(x) != 1 or readers.count(producer.input[1]) != 1:
        return None
    inv = nh.to_array(inits[producer.input[1]]).astype(np.float32)
    return (producer, inv) if inv.shape == (k,) else None


def _gelu_shift(graph: onnx.GraphProto, x: str, k: int, inits: dict) -> np.ndarray | None:
    """c [K] with x + c >= 0 when x is a GELU output (directly, or times a constant smoothing vector)."""
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get(x)
    scale = np.ones(k, np.float32)
    if node is not None and node.op_type == "Mul" and len(node.input) == 2 and node.input[1] in inits:
        scale = nh.to_array(inits[node.input[1]]).astype(np.float32)
        if scale.shape != (k,) or not (scale > 0).all():
            return None
        node = producer.get(node.input[0])
    if node is None or node.op_type not in GELU_OPS:
        return None
    return (GELU_MIN * scale).astype(np.float32)


def _row_quantize_unsigned(p: str, x: str) -> list[onnx.NodeProto]:
    return [
        helper.make_node("Add", [x, p + "/shift"], [p + "/xs"]),  # >= 0
        helper.make_node("ReduceMax", [p + "/xs", _C + "last_axis"], [p + "/max"], keepdims=1),
        helper.make_node("Max", [p + "/max", _C + "eps"], [p + "/pmax"]),
        helper.make_node("Mul", [p + "/pmax", _C + "inv255"], [p + "/scale"]),  # [..., 1]
        helper.make_node("Reshape", [p + "/scale", _C + "flat"], [p + "/scale_rows"]),  # [T]
        helper.make_node("Shape", [p + "/scale_rows"], [p + "/rows"]),
        helper.make_node("Expand", [_C + "zp0", p + "/rows"], [p + "/zp_rows"]),
        helper.make_node("Shape", [p + "/xs"], [p + "/x_shape"]),
        helper.make_node("Reshape", [p + "/xs", p + "/rows_k"], [p + "/x_rows"]),  # [T, K]
        helper.make_node("QuantizeLinear", [p + "/x_rows", p + "/scale_rows", p + "/zp_rows"], [p + "/q_rows"], axis=0),
        helper.make_node("Reshape", [p + "/q_rows", p + "/x_shape"], [p + "/q"]),
    ]


def _mmitf(p: str, out: str, zp: str = _C + "zp") -> onnx.NodeProto:
    # The per-row a_scale broadcasts over the output columns. (Its optional bias
    # input is left out: in ORT 1.32 it did not match x @ W + b; biases stay where
    # the graph had them — BiasGelu, SkipLayerNormalization, MultiHeadAttention.)
    return helper.make_node("MatMulIntegerToFloat", [p + "/q", p + "/wq", p + "/scale", p + "/ws", zp, _C + "wzp"],
                            [out], domain="com.microsoft")


def _prune_unused(model: onnx.ModelProto) -> None:
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    drop_initializers(model.graph, lambda init: init.name not in used)
