"""INT8 designs side by side: accuracy on the held-out queries and engine speed against FP32, one run.

    PYTHONPATH=src python3 benchmarks/int8_designs.py --fp32 DIR [--int8 DIR] [--threads 1 2] [--write-artifacts DIR]

From the FP32 artifact (`surge optimize --precision fp32`), with the default INT8 recipe's smoothing
(SmoothQuant alpha, `--alpha`) and GPTQ weights, it builds the batch-invariant designs that need no
kernel ONNX Runtime lacks:

* per-row, every node: the default chain (a scale per token row, rowquant.py) on all 24 nodes, no FP32 node;
* static, every node: one calibrated uint8 grid per node input (min/max over the calibration queries'
  real tokens), one QuantizeLinear, no per-row reductions: the fastest INT8 graph ONNX Runtime runs;
* INT8 artifacts given with `--int8` (`surge optimize --precision int8` outputs: the default recipe's), if any.

For each: held-out mean / min cosine and strict / ties retrieval top-1 against FP32 (the gate's
measures and sets), a sentence alone against beside long neighbours, and the engine's time at serving
batches (held-out queries in length-sorted batches of `--batch`, as the batcher groups them; FP32 and
every design interleaved per round; medians). `--write-artifacts` writes each design as an artifact
directory (the INT8 artifact's files with its model) for `benchmarks/optimizer.py --issue21
--serve-only --int8-artifact DIR`. Numbers: docs/benchmarks/optimizer.md, issue 21, session 7.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import onnx


def serving_batches(spec, texts: list[str], batch: int, count: int, seed: int = 0) -> list[dict]:
    """`count` batches of `batch` random texts, length-sorted before cutting (the batcher's grouping), padded."""
    from surge.optimize.validate import encode_texts
    from surge.types import TokenBatch

    rng = np.random.default_rng(seed)
    pick = [texts[i] for i in rng.choice(len(texts), batch * count, replace=len(texts) < batch * count)]
    items = sorted(encode_texts(spec, pick), key=len)
    out = []
    for i in range(count):
        b = TokenBatch.pad(items[i * batch:(i + 1) * batch], pad_id=spec.pad_token_id)
        out.append({"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids})
    return out


def engine_times(models: dict[str, bytes], batches: list[dict], threads: int, rounds: int) -> dict[str, float]:
    """Median seconds per batch of each model over `rounds` interleaved passes through `batches`."""
    from surge.optimize.validate import session

    runners = {}
    for name, model in models.items():
        sess = session(model, threads)
        keep = {i.name for i in sess.get_inputs()}
        feeds = [{k: v for k, v in b.items() if k in keep} for b in batches]
        for f in feeds[:3]:
            sess.run(None, f)
        runners[name] = (sess, feeds)
    return interleaved(runners, rounds)


def interleaved(runners: dict[str, tuple], rounds: int) -> dict[str, float]:
    """Median seconds per feed of each (session, feeds) over `rounds` passes, the runners taking turns."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, (sess, feeds) in runners.items():
            t = time.perf_counter()
            for f in feeds:
                sess.run(None, f)
            times[name].append((time.perf_counter() - t) / len(feeds))
    return {name: float(np.median(v)) for name, v in times.items()}


def build_designs(fp32: onnx.ModelProto, batches, alpha: float, threads: int) -> dict[str, onnx.ModelProto]:
    from surge.optimize.gptq import gptq_weights
    from surge.optimize.rowquant import activation_ranges, quantize_rows
    from surge.optimize.smooth import activation_absmax, smooth

    smoothed, _ = smooth(fp32, activation_absmax(fp32, batches, threads), alpha)
    weights = gptq_weights(smoothed, batches, threads)
    return {"per-row, every node": quantize_rows(smoothed, weights=weights)[0],
            "static, every node": quantize_rows(smoothed, weights=weights,
                                                static=activation_ranges(smoothed, batches, threads))[0]}


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from surge.data import calibration_queries, heldout_queries
    from surge.models import load_model_spec
    from surge.optimize.validate import Evaluator

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fp32", required=True, type=Path, help="FP32 artifact directory")
    p.add_argument("--int8", type=Path, nargs="*", default=[], help="INT8 artifact directories to compare too "
                   "(each labelled by its directory name)")
    p.add_argument("--alpha", type=float, default=0.65, help="SmoothQuant strength (the default recipe's choice)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sentences", type=int, default=0, help="held-out queries measured (0: all)")
    p.add_argument("--write-artifacts", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    console = Console(width=170)
    from optimizer_issue21 import invariance  # this script's folder is on sys.path

    spec = load_model_spec(a.fp32)
    fp32_bytes = (a.fp32 / "model.onnx").read_bytes()
    heldout = heldout_queries()
    heldout = heldout[:a.sentences] if a.sentences else heldout
    t0 = time.perf_counter()
    console.print("FP32 reference on the calibration and held-out queries")
    ev = Evaluator(spec, fp32_bytes, calibration_queries(), heldout, threads=max(a.threads))
    console.print(f"building the designs (alpha {a.alpha}, GPTQ weights) [{time.perf_counter() - t0:.0f} s]")
    designs = build_designs(onnx.ModelProto.FromString(fp32_bytes), ev.data["calibration"].batches, a.alpha,
                            max(a.threads))
    models = {name: m.SerializeToString() for name, m in designs.items()}
    for d in a.int8:
        models[f"artifact {d.name}"] = (d / "model.onnx").read_bytes()
    results: dict = {"designs": {}}
    long = sorted(calibration_queries(), key=len)[-3:]
    for name, model in models.items():
        console.print(f"accuracy: {name} [{time.perf_counter() - t0:.0f} s]")
        h = ev.metrics(model, sets=("heldout",))["heldout"]
        inv = invariance(model, spec, heldout[:24], long, max(a.threads))
        # whole nodes left in FP32 (the outlier split's small K=4 products belong to their rowq/ node)
        ops = [n.op_type for n in onnx.ModelProto.FromString(model).graph.node if not n.name.startswith("rowq/")]
        results["designs"][name] = {"heldout_mean_cosine": h.mean_cosine, "heldout_min_cosine": h.min_cosine,
                                    "top1": h.top1, "top1_ci95": h.top1_ci95, "top1_tie": h.top1_tie,
                                    "alone_vs_batched_min_cosine": inv["min_cosine"],
                                    "fp32_matmul_nodes": ops.count("MatMul") + ops.count("Attention"),
                                    "nodes": len(ops)}
    batches = serving_batches(spec, heldout, a.batch, a.batches)
    lengths = [b["input_ids"].shape[1] for b in batches]
    results["serving_batches"] = {"batch": a.batch, "count": a.batches, "padded_lengths": lengths}
    for threads in a.threads:
        console.print(f"engine time, {threads} thread(s), {a.rounds} interleaved rounds [{time.perf_counter() - t0:.0f} s]")
        times = engine_times({"FP32": fp32_bytes, **models}, batches, threads, a.rounds)
        results[f"ms_per_batch_{threads}t"] = {k: round(v * 1e3, 3) for k, v in times.items()}
        for name in models:
            results["designs"][name][f"speedup_{threads}t"] = round(times["FP32"] / times[name], 3)
    table = Table(title=f"INT8 designs vs FP32: {len(heldout)} held-out queries; engine at {a.batch}-query batches")
    for col in ("design", "mean cos", "min cos", "top-1 [95% CI]", "ties top-1", "alone vs batched",
                "FP32 nodes", *[f"x FP32 ({t}t)" for t in a.threads]):
        table.add_column(col, justify="left" if col == "design" else "right")
    for name, r in results["designs"].items():
        ci = r["top1_ci95"]
        table.add_row(name, f"{r['heldout_mean_cosine']:.5f}", f"{r['heldout_min_cosine']:.4f}",
                      f"{r['top1']:.4f} [{ci[0]:.3f}, {ci[1]:.3f}]", f"{r['top1_tie']:.4f}",
                      f"{r['alone_vs_batched_min_cosine']:.6f}", str(r["fp32_matmul_nodes"]),
                      *[f"{r[f'speedup_{t}t']:.2f}x" for t in a.threads])
    console.print(table)
    for threads in a.threads:
        console.print(f"ms a batch, {threads} thread(s): {results[f'ms_per_batch_{threads}t']}")
    if a.write_artifacts:
        src = a.int8[0] if a.int8 else a.fp32
        for name, model in models.items():
            if name.startswith("artifact "):
                continue
            out = a.write_artifacts / name.split(",")[0].replace(" ", "-")
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(src, out)
            (out / "model.onnx").write_bytes(model)
            manifest = json.loads((out / "manifest.json").read_text())
            manifest.update(precision="int8", design=name, forced=True)
            (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
            console.print(f"wrote {out}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
