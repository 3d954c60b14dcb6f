"""SmoothQuant-style migration of activation outliers into the weights, before INT8.

Dynamic INT8 quantizes every MatMul input with one scale per tensor, so a few
outlier channels (MiniLM's FFN inputs reach 28 in one channel where the median
channel stays under 2) set the step for all the others. For an input channel j
of X @ W, X[:, j] / s_j times W[j, :] * s_j is the same product; with

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

the outlier channels shrink and the weights (quantized per output column,
where one larger row costs little) absorb the difference. Xiao et al., 2023,
"SmoothQuant: Accurate and Efficient Post-Training Quantization for LLMs".

Choices made here, each measured on the bundled MiniLM (docs/benchmarks/optimizer.md):
- Channel maxima are taken over *all* positions of padded calibration batches,
  padding included: ONNX Runtime's dynamic scale covers the whole batch tensor,
  and a channel amplified from real-token statistics lets a padded row set
  the range (measured: cos 0.998 at batch 1 fell to 0.991 in padded batches).
- s_j is at least 1: channels are only ever shrunk, never amplified, so no
  input row can grow past the range the unsmoothed model had.
- Where an input is the output of a fused Attention used only by this MatMul
  (the attention output projection), 1/s is folded into the V columns of the
  packed QKV weight and bias (the context is linear in V): no extra node.
  Elsewhere (LayerNorm outputs that also feed the residual, GELU outputs) a
  Mul by 1/s is inserted in front of the MatMul.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper
from onnx import numpy_helper as nh

SMOOTHED_OPS = ("MatMul", "Attention")


@dataclass
class SmoothInfo:
    alpha: float
    nodes: list[dict] = field(default_factory=list)  # per node: name, how, channels shrunk, largest s

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "method": "smoothquant (per input channel, s >= 1)",
                "muls_inserted": sum(1 for n in self.nodes if n["how"] == "mul"),
                "folded_into_v": sum(1 for n in self.nodes if n["how"] == "fold_v"), "nodes": self.nodes}


def weighted_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """MatMul / Attention nodes whose weight (input 1) is a 2-D initializer: what INT8 quantizes."""
    inits = {i.name: i for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type in SMOOTHED_OPS and n.domain in ("", "ai.onnx", "com.microsoft")
            and len(n.input) > 1 and n.input[1] in inits and len(inits[n.input[1]].dims) == 2]


def probe_inputs(model: onnx.ModelProto, wanted: list[str], batches, threads: int = 0):
    """Each batch's values of the tensors `wanted` (exposed as extra outputs): yields (batch, {name: array})."""
    from surge.optimize.validate import session

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for name in wanted:
        if name not in present:
            probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    sess = session(probe.SerializeToString(), threads)
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name for i in sess.get_inputs()}
    for b in batches:
        feeds = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids}
        values = sess.run(None, {k: v for k, v in feeds.items() if k in inputs})
        yield b, {name: v for name, v in zip(names, values) if name in wanted}


def activation_absmax(model: onnx.ModelProto, batches, threads: int = 0) -> dict[str, np.ndarray]:
    """Per input channel max |x| of every weighted node's input, over all positions of the batches."""
    wanted = sorted({n.input[0] for n in weighted_nodes(model)})
    amax: dict[str, np.ndarray] = {}
    for _, values in probe_inputs(model, wanted, batches, threads):
        for name, value in values.items():
            m = np.abs(value.reshape(-1, value.shape[-1])).max(0)
            amax[name] = np.maximum(amax[name], m) if name in amax else m
    return amax


def smooth(model: onnx.ModelProto, absmax: dict[str, np.ndarray], alpha: float,
           max_scale: float = 100.0) -> tuple[onnx.ModelProto, SmoothInfo]:
    """A numerically equivalent model whose weighted-node inputs have their outlier channels shrunk."""
    out = onnx.ModelProto.FromString(model.SerializeToString())
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    info = SmoothInfo(alpha)
    inserted: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []
    for node in weighted_nodes(out):
        x = node.input[0]
        if x not in absmax or consumers.get(node.input[1], 0) != 1:
            continue  # a weight shared by two nodes cannot carry two different scalings
        w = nh.to_array(inits[node.input[1]]).astype(np.float32)
        if w.shape[0] != absmax[x].shape[0]:
            continue
        s = (np.maximum(absmax[x], 1e-5) ** alpha / np.maximum(np.abs(w).max(1), 1e-5) ** (1 - alpha))
        s = np.clip(s, 1.0, max_scale).astype(np.float32)
        if not (s > 1.0).any():
            continue
        _set(inits[node.input[1]], w * s[:, None])
        p = producer.get(x)
        if p is not None and p.op_type == "Attention" and consumers.get(x) == 1 and _fold_into_v(p, inits, consumers, s):
            how = "fold_v"
        else:
            inv = f"{node.name or node.output[0]}_smooth_inv"
            graph.initializer.append(nh.from_array((1.0 / s).astype(np.float32), inv))
            smoothed = f"{x}_smoothed_for_{node.name or node.output[0]}"
            inserted.append((node, helper.make_node("Mul", [x, inv], [smoothed], name=f"{node.name}_smooth")))
            node.input[0] = smoothed
            how = "mul"
        info.nodes.append({"node": node.name, "how": how, "channels_shrunk": int((s > 1.0).sum()),
                           "max_scale": round(float(s.max()), 3)})
    if inserted:  # each Mul goes right before its MatMul: the graph stays topologically sorted
        order = list(graph.node)
        for target, mul in inserted:
            order.insert(order.index(target), mul)
        del graph.node[:]
        graph.node.extend(order)
    return out, info


def _fold_into_v(attention: onnx.NodeProto, inits: dict, consumers: dict, s: np.ndarray) -> bool:
    """Divide the V block of a packed-QKV Attention's weight and bias by s (context = softmax(QK) V)."""
    if len(attention.input) < 3 or attention.input[1] not in inits or attention.input[2] not in inits:
        return False
    if consumers.get(attention.input[1]) != 1 or consumers.get(attention.input[2]) != 1:
        return False
    if any(a.name == "qkv_hidden_sizes" for a in attention.attribute):
        return False  # unequal Q/K/V widths: not the packed layout assumed below
    w, b = nh.to_array(inits[attention.input[1]]).astype(np.float32), nh.to_array(inits[attention.input[2]]).astype(np.float32)
    h = w.shape[1] // 3
    if w.shape[1] != 3 * h or h != s.shape[0] or b.shape != (3 * h,):
        return False
    w, b = w.copy(), b.copy()
    w[:, 2 * h :] /= s
    b[2 * h :] /= s
    _set(inits[attention.input[1]], w)
    _set(inits[attention.input[2]], b)
    return True


def _set(init: onnx.TensorProto, value: np.ndarray) -> None:
    init.CopyFrom(nh.from_array(value.astype(nh.to_array(init).dtype), init.name))
