"""Keep the SkipLayerNormalization fusion only where it is faster: a measured decision.

ONNX Runtime's transformer fusions turn each residual Add + LayerNormalization
into one com.microsoft SkipLayerNormalization, and the attention fusion needs
that form to match, so the passes always produce it. On the CPU kernels of
ONNX Runtime 1.32 the fused op was the slower one here: 60-100 us against
28-38 us for Add + LayerNormalization on a [32, 384] input (2-core Sapphire
Rapids VM), ~6% of MiniLM's whole batch-1 forward. Kernels change between ORT
versions and CPUs, so `surge optimize --target cpu` times both graphs on the
machine that optimizes and keeps the faster; the manifest records the times.
The split graph is the same arithmetic (fp32 sums in another order, ~1e-6).
"""

from __future__ import annotations

import time

import numpy as np
import onnx
from onnx import helper

from surge.engines.base import random_batch

# ONNX Runtime re-fuses what it recognizes at session load; a split artifact
# asks its engine to leave these optimizers out (engines/onnxrt.py reads it).
DISABLED_OPTIMIZERS = ["SkipLayerNormFusion"]


def split_skip_layernorm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Each SkipLayerNormalization -> Add(input, skip) [+ Add(bias)] -> LayerNormalization."""
    out = onnx.ModelProto.FromString(model.SerializeToString())
    nodes, n = [], 0
    for node in out.graph.node:
        if node.op_type != "SkipLayerNormalization" or node.domain != "com.microsoft" or len(node.output) > 1 and any(
                node.output[1:3]):
            nodes.append(node)  # mean / inv-std outputs in use: keep the fused op
            continue
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-12)
        x, skip, gamma = node.input[:3]
        beta = node.input[3] if len(node.input) > 3 else ""
        bias = node.input[4] if len(node.input) > 4 else ""
        total = f"{node.name or node.output[0]}_residual"
        nodes.append(helper.make_node("Add", [x, skip], [total], name=f"{node.name}_add"))
        if bias:
            nodes.append(helper.make_node("Add", [total, bias], [total + "_bias"], name=f"{node.name}_add_bias"))
            total += "_bias"
        if len(node.output) > 3 and node.output[3]:  # the input + skip + bias sum, used as the next residual
            nodes.append(helper.make_node("Identity", [total], [node.output[3]], name=f"{node.name}_sum"))
        nodes.append(helper.make_node("LayerNormalization", [total, gamma] + ([beta] if beta else []),
                                      [node.output[0]], name=f"{node.name}_ln", axis=-1, epsilon=eps))
        n += 1
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    for opset in out.opset_import:  # LayerNormalization is opset 17
        if opset.domain in ("", "ai.onnx") and opset.version < 17:
            opset.version = 17
    return out, n


def choose(model: onnx.ModelProto, vocab: int, threads: int = 0, rounds: int = 8,
           runs: int = 40) -> tuple[onnx.ModelProto, dict]:
    """(the faster of the fused and split graphs, what was measured) at batch 1 x 32 tokens."""
    split, n = split_skip_layernorm(model)
    if n == 0:
        return model, {"split": False, "why": "no SkipLayerNormalization in the graph"}
    b = random_batch(1, 32, min(vocab, 30522))
    feeds = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids}
    from surge.optimize.validate import session

    runners = {}
    for name, m, disabled in (("fused", model, []), ("split", split, DISABLED_OPTIMIZERS)):
        sess = session(m.SerializeToString(), threads, disabled, spinning=False)  # as the serving engine runs
        names = {i.name for i in sess.get_inputs()}
        f = {k: v for k, v in feeds.items() if k in names}
        runners[name] = (sess, f)
    times: dict[str, list[float]] = {"fused": [], "split": []}
    for _ in range(rounds):  # interleaved rounds: a drifting shared CPU hits both alike
        for name, (sess, f) in runners.items():
            sess.run(None, f)
            for _ in range(runs):
                t = time.perf_counter()
                sess.run(None, f)
                times[name].append(time.perf_counter() - t)
    ms = {k: float(np.median(v) * 1e3) for k, v in times.items()}
    keep = ms["split"] < ms["fused"]
    info = {"split": keep, "nodes": n, "median_ms_b1_s32": {k: round(v, 3) for k, v in ms.items()},
            "ort_disabled_optimizers": DISABLED_OPTIMIZERS if keep else []}
    return (split if keep else model), info
