"""FP32 fallback for FP16 / BF16 task graphs, measured on the task's own metric.

A task graph ends in its head: the logits. Rounding them (and the last layers'
activations) to FP16 moves labels whose FP32 top-2 margin is small; a token
tagger has thousands of such tokens (the trained slot tagger: 0.9936 per-token
agreement against the FP16 budget's 0.995). The op-type block list cannot help
there (the head is a MatMul, as every projection is). So, when the calibration
set misses the budget, this measures each weighted node's sensitivity — the task
metric gained (labels / tokens kept, NDCG@10; the logits' tail cosine breaking
ties: SetMetrics.objective) by keeping only that node, with its bias Add, in
FP32 — on the calibration sentences the plain conversion gets worst, and keeps
nodes in FP32 in that order until the budget is met: the fewest sensitive nodes,
at most a quarter of them. The head (the weighted node nearest the logits) is
tried alone first: one measurement, and the usual answer for a tagger. INT8 does the
same inside its own search (int8_search.py). The held-out set is never looked at
here; the pipeline's gate checks it afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from surge.optimize.validate import Budget, Evaluator, check

HARD_SENTENCES = 160
MAX_FP32_FRACTION = 0.25


def weighted_groups(model: onnx.ModelProto) -> list[list[str]]:
    """Each MatMul / Gemm with a constant weight, with the Add that adds its constant bias: the
    units kept in FP32 together (an FP32 MatMul whose bias Add is FP16 would still round its output)."""
    inits = {i.name for i in model.graph.initializer}
    consts = inits | {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    groups = []
    for n in model.graph.node:
        if n.op_type not in ("MatMul", "Gemm") or not n.name or not any(i in consts for i in n.input[1:2]):
            continue
        group = [n.name]
        after = readers.get(n.output[0], [])
        if len(after) == 1 and after[0].op_type == "Add" and after[0].name and any(i in consts for i in after[0].input):
            group.append(after[0].name)
        groups.append(group)
    return groups


def nearest_output(model: onnx.ModelProto, names: set[str]) -> list[str]:
    """The nodes among `names` closest to the graph's outputs: walking back from each output, the
    first one met on every path (a task graph's head projection)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    found, seen, stack = [], set(), [o.name for o in model.graph.output]
    while stack:
        node = producer.get(stack.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name in names:
            found.append(node.name)
        else:
            stack.extend(node.input)
    return found


def search_fp32_nodes(proto: onnx.ModelProto, build: Callable[[list[str]], onnx.ModelProto], evaluator: Evaluator,
                      budget: Budget, progress: Callable[[str], None] | None = None,
                      max_fraction: float = MAX_FP32_FRACTION) -> tuple[list[str], dict]:
    """(node names to keep in FP32, search record). `build(nodes)` returns the candidate model, as
    validated (the emulation for FP16 / BF16), with `nodes` kept in FP32."""
    say = progress or (lambda _: None)

    def measure(nodes: list[str], subset: str):
        return evaluator.metrics(build(nodes).SerializeToString(), sets=(subset,))[subset]

    start = measure([], "calibration")
    info: dict = {"measured_on": "calibration", "steps": [{"kept_fp32": [], "objective": round(start.objective, 6),
                                                           "passed": check(budget, {"c": start}).passed}]}
    if check(budget, {"c": start}).passed:
        return [], info
    hard = evaluator.add_subset("hard", start.order_worst[:HARD_SENTENCES], "calibration")
    info["hard_sentences"] = hard
    groups = weighted_groups(proto)
    limit = max(1, int(max_fraction * len(groups)))
    head = [g for g in groups if g[0] in set(nearest_output(proto, {g[0] for g in groups}))]
    if head:  # the head first: its rounding moves near-tie labels directly; one measurement when it suffices
        kept = [n for g in head for n in g]
        say(f"fp32 fallback: the head ({', '.join(g[0] for g in head)}) in FP32")
        m = measure(kept, "hard")
        if check(budget, {"hard": m}).passed:
            m = measure(kept, "calibration")
            passed = check(budget, {"calibration": m}).passed
            info["steps"].append({"kept_fp32": kept, "objective": round(m.objective, 6), "passed": passed,
                                  "why": "head first"})
            if passed:
                info["max_fp32"] = limit
                return kept, info
        else:
            info["steps"].append({"kept_fp32": kept, "passed": False, "measured_on": "hard", "why": "head first"})
    base = measure([], "hard").objective
    gain = {}
    for i, g in enumerate(groups):
        say(f"fp32 fallback: sensitivity of {g[0]} ({i + 1}/{len(groups)}, on the {hard} hardest calibration sentences)")
        gain[g[0]] = round(measure(g, "hard").objective - base, 9)
    order = sorted(groups, key=lambda g: gain[g[0]], reverse=True)
    info["sensitivity"] = {g[0]: gain[g[0]] for g in order}
    kept: list[str] = []
    for n, g in enumerate(order[:limit], 1):
        kept += g
        say(f"fp32 fallback: keeping {n} weighted node(s) in FP32")
        if not check(budget, {"hard": measure(kept, "hard")}).passed:
            info["steps"].append({"kept_fp32": list(kept), "passed": False, "measured_on": "hard"})
            continue
        m = measure(kept, "calibration")  # the hard subset passes: confirm on the whole calibration set
        passed = check(budget, {"calibration": m}).passed
        info["steps"].append({"kept_fp32": list(kept), "objective": round(m.objective, 6), "passed": passed})
        if passed:
            info["max_fp32"] = limit
            return kept, info
    info["max_fp32"] = limit
    return kept, info
