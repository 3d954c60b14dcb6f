"""Issue 21, session 14: the per-row quantization chain with ONNX's blocked QuantizeLinear (opset 21).

    PYTHONPATH=src python3 benchmarks/int8_blocked_chain.py --int8 INT8_ARTIFACT --fp32 FP32_ARTIFACT [--rounds 15]

optimize/rowquant.py quantizes each weighted node's input per token row with ~12 operators: the row's max and
min, the scale, then Reshape to [T, K], Shape / Expand for a per-row zero point, a per-axis QuantizeLinear and a
Reshape back; the outlier split adds Reshape / Shape around its Gemm. At the server's batches (8 queries of ~10
tokens) ONNX Runtime's per-operator cost is a visible share of the INT8 run. Opset 21's blocked QuantizeLinear
(axis -1, block_size K, scale [..., 1]) quantizes rows in place, without the reshapes: this script rewrites an
artifact's chains that way (the same scales, the same rounding: outputs must be equal bit for bit, checked),
then times the two graphs and FP32 interleaved at length-sorted 8-query batches of held-out queries, one
thread, and prints each round (this VM's rounds are bimodal under a neighbour's load: compare quiet rounds).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
from onnx import helper
from onnx import numpy_helper as nh


def blocked(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every per-axis row QuantizeLinear (Reshape x -> QL(axis 0) -> Reshape back) replaced by one
    blocked QuantizeLinear on the unreshaped input."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    g = m.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    new_nodes, replaced = [], {}
    for n in g.node:
        if n.op_type != "QuantizeLinear" or not n.output[0].endswith("/q_rows"):
            continue
        p = n.output[0][: -len("/q_rows")]
        x_rows, scale_rows, zp_rows = n.input
        x = producer[x_rows].input[0]
        k = int(nh.to_array(inits[producer[x_rows].input[1]])[-1])
        scale = producer[scale_rows].input[0]  # [..., 1]
        zp_value = nh.to_array(inits[producer[zp_rows].input[0]])
        nodes = []
        if int(zp_value) == 0:  # unsigned rows: the default zero point (uint8 0)
            ins = [x, scale]
        else:
            g.initializer.append(nh.from_array(zp_value, p + "/zp_scalar"))
            nodes = [helper.make_node("Shape", [scale], [p + "/scale_shape"]),
                     helper.make_node("Expand", [p + "/zp_scalar", p + "/scale_shape"], [p + "/zp_full"])]
            ins = [x, scale, p + "/zp_full"]
        nodes.append(helper.make_node("QuantizeLinear", ins, [p + "/q"], axis=-1, block_size=k))
        replaced[p + "/q"] = nodes
    # keep every node not writing a replaced chain's q; the chain's new nodes where its old Reshape back stood
    for n in g.node:
        out = n.output[0] if n.output else ""
        if out in replaced:
            new_nodes += replaced[out]
        else:
            new_nodes.append(n)
    del g.node[:]
    g.node.extend(new_nodes)
    _prune(m)
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = max(o.version, 21)
    m.ir_version = max(m.ir_version, 10)
    return m


def _prune(m: onnx.ModelProto) -> None:
    """Drop nodes whose outputs nothing reads (the reshapes the blocked form no longer needs), to a fixed point."""
    g = m.graph
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        keep = [n for n in g.node if any(o in used for o in n.output)]
        if len(keep) == len(g.node):
            break
        del g.node[:]
        g.node.extend(keep)
    from surge.optimize.rowquant import _prune_unused

    _prune_unused(m)  # the initializers the dropped nodes read


def main() -> None:
    from int8_designs import serving_batches  # this script's folder is on sys.path
    from surge.data import heldout_queries
    from surge.models.hf import load_model_spec
    from surge.optimize.validate import session

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--int8", required=True)
    ap.add_argument("--fp32", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    src = onnx.load(f"{a.int8}/model.onnx")
    new = blocked(src)
    spec = load_model_spec(a.int8)
    batches = serving_batches(spec, heldout_queries(), a.batch, a.batches)
    models = {"int8 per-axis chain": src.SerializeToString(), "int8 blocked chain": new.SerializeToString(),
              "fp32": onnx.load(f"{a.fp32}/model.onnx").SerializeToString()}
    runners = {}
    for name, model in models.items():
        sess = session(model, 1, spinning=False)
        keep = {i.name for i in sess.get_inputs()}
        feeds = [{k: v for k, v in b.items() if k in keep} for b in batches]
        runners[name] = (sess, feeds)
    outs = {name: [s.run(None, f)[0] for f in fl] for name, (s, fl) in runners.items()}
    same = all(np.array_equal(x, y) for x, y in zip(outs["int8 per-axis chain"], outs["int8 blocked chain"]))
    print(f"nodes: {len(src.graph.node)} -> {len(new.graph.node)}; outputs equal bit for bit: {same}")
    if not same:
        raise SystemExit("the blocked graph's outputs differ: not the same arithmetic")
    times = {name: [] for name in runners}
    for r in range(a.rounds):
        for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
            sess, feeds = runners[name]
            t = time.perf_counter()
            for f in feeds:
                sess.run(None, f)
            times[name].append((time.perf_counter() - t) * 1e3 / (len(feeds) * a.batch))
    print(f"ms a query, {a.batch}-query batches, 1 thread, {a.rounds} interleaved rounds")
    print("| graph | median | min | rounds |\n|---|---:|---:|---|")
    for name, v in times.items():
        print(f"| {name} | {np.median(v):.3f} | {min(v):.3f} | {' '.join(f'{x:.2f}' for x in v)} |")
    base = np.array(times["int8 per-axis chain"])
    ratio = np.array(times["int8 per-axis chain"]) / np.array(times["int8 blocked chain"])
    print(f"per-round speedup of the blocked chain: median {np.median(ratio):.3f} "
          f"(range {ratio.min():.3f}-{ratio.max():.3f}); FP32 / per-axis INT8: "
          f"{np.median(np.array(times['fp32']) / base):.2f}x")


if __name__ == "__main__":
    main()
