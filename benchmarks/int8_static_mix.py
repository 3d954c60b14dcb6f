"""Issue 21, session 13: how many of the INT8 plan's per-row activation chains can be a static grid instead.

    PYTHONPATH=src python3 benchmarks/int8_static_mix.py --fp32 FP32_ARTIFACT [--mixes 0 6 12 16 20 24] [--json F]

The default recipe (SmoothQuant alpha 0.65, the 4-channel outlier split, GPTQ weights) with k of its 24 nodes
on a static grid (one calibrated QuantizeLinear; the range over the calibration queries' real tokens, the split
channels left out: `activation_ranges(..., outliers=)`) and the rest per row. Nodes go static in the order of
their measured sensitivity (calibration mean cosine with that node alone static, least harmed first). For each
k: calibration and held-out accuracy as the gate measures it (strict top-1 with its 95% interval), and the
engine's time a query at the server's batches (length-sorted held-out queries, `--batch` a batch, one thread,
FP32 and every mix interleaved). A static grid drops the per-row reductions (~12 operators a node): the
fastest INT8 graph ONNX Runtime runs, and the coarsest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import onnx


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from int8_designs import engine_times, serving_batches  # this script's folder is on sys.path
    from surge.data import calibration_queries, heldout_queries
    from surge.models import load_model_spec
    from surge.optimize.gptq import gptq_weights
    from surge.optimize.int8_search import OUTLIER_CHANNELS
    from surge.optimize.rowquant import activation_ranges, outlier_channels, quantizable, quantize_rows
    from surge.optimize.smooth import activation_absmax, smooth
    from surge.optimize.validate import Evaluator

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fp32", required=True, type=Path, help="FP32 artifact directory (surge optimize --precision fp32)")
    p.add_argument("--mixes", type=int, nargs="+", default=[0, 6, 12, 16, 20, 24], help="static nodes in each mix")
    p.add_argument("--alpha", type=float, default=0.65)
    p.add_argument("--threads", type=int, default=2, help="threads of the accuracy runs (timing: one)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    console = Console(width=160)
    t0 = time.perf_counter()
    spec = load_model_spec(a.fp32)
    fp32 = onnx.load(str(a.fp32 / "model.onnx"))
    console.print("FP32 reference on the calibration and held-out queries")
    ev = Evaluator(spec, fp32.SerializeToString(), calibration_queries(), heldout_queries(), threads=a.threads)
    cal = ev.data["calibration"].batches
    console.print(f"the default recipe: smoothing, outlier split, GPTQ [{time.perf_counter() - t0:.0f} s]")
    smoothed, _ = smooth(fp32, activation_absmax(fp32, cal, a.threads), a.alpha)
    split = outlier_channels(smoothed, activation_absmax(smoothed, cal, a.threads), OUTLIER_CHANNELS)
    weights = gptq_weights(smoothed, cal, a.threads, outliers=split)
    ranges = activation_ranges(smoothed, cal, a.threads, outliers=split)

    def build(static: list[str]) -> onnx.ModelProto:
        return quantize_rows(smoothed, weights=weights, outliers=split, static={n: ranges[n] for n in static})[0]

    names = [n.name for n in quantizable(smoothed)]
    base = ev.metrics(build([]).SerializeToString(), sets=("calibration",))["calibration"]
    sensitivity = {}
    for i, name in enumerate(names):
        console.print(f"sensitivity {i + 1}/{len(names)}: {name} [{time.perf_counter() - t0:.0f} s]")
        m = ev.metrics(build([name]).SerializeToString(), sets=("calibration",))["calibration"]
        sensitivity[name] = m.mean_cosine - base.mean_cosine
    order = sorted(names, key=lambda n: sensitivity[n], reverse=True)
    models, rows = {"fp32": fp32.SerializeToString()}, {}
    for k in a.mixes:
        console.print(f"{k} static node(s): accuracy [{time.perf_counter() - t0:.0f} s]")
        model = build(order[:k]).SerializeToString()
        models[f"{k} static"] = model
        rows[k] = {s: m.to_json() for s, m in ev.metrics(model).items()}
    console.print("engine times (one thread, interleaved)")
    times = engine_times(models, serving_batches(spec, heldout_queries(), a.batch, a.batches), 1, a.rounds)
    table = Table(title=f"INT8 with k static nodes (the rest per row), batches of {a.batch}, one thread")
    for col in ("static nodes", "cal. top-1", "held-out min cos", "held-out top-1 [95% CI]", "ms a query", "x FP32"):
        table.add_column(col, justify="right")
    fp32_ms = times["fp32"] / a.batch * 1e3
    for k, r in rows.items():
        h, c = r["heldout"], r["calibration"]
        ms = times[f"{k} static"] / a.batch * 1e3
        table.add_row(str(k), f"{c['top1']:.4f}", f"{h['min_cosine']:.5f}",
                      f"{h['top1']:.4f} [{h['top1_ci95'][0]:.3f}, {h['top1_ci95'][1]:.3f}]", f"{ms:.3f}", f"{fp32_ms / ms:.2f}x")
    console.print(table)
    console.print(f"FP32 {fp32_ms:.3f} ms a query; order (least sensitive first): {order}")
    if a.json:
        strip = lambda m: {k: v for k, v in m.items() if k != "worst"}  # noqa: E731
        a.json.write_text(json.dumps({"fp32_ms_per_query": fp32_ms, "order": order, "sensitivity": sensitivity,
                                      "mixes": {k: {"ms_per_query": times[f"{k} static"] / a.batch * 1e3,
                                                    **{s: strip(m) for s, m in r.items()}} for k, r in rows.items()}},
                                     indent=1, default=float))


if __name__ == "__main__":
    main()
