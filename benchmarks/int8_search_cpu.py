"""The INT8 search's work outside ONNX Runtime's kernels, against the forms it replaced, in the same run.

`surge optimize --precision int8` builds and measures dozens of candidate graphs of the bundled MiniLM
(int8_search.build_int8). Three parts of a candidate are timed here, each beside its old form, with
equal results checked:

1. GPTQ's feedback factor U (U^T U = H^-1) at the model's two input widths, from the real input
   moments of the calibration sentences: `cholesky(inv(H)).T` (the old form) against
   gptq.feedback_factor (one Cholesky of the reversed H and a triangular inverse).
2. rowquant.quantize_rows on the smoothed, fused graph: a whole copy of the graph
   (`FromString(SerializeToString())`) and the unused initializers dropped by clearing the list and
   extending it with the kept ones (old), against a copy without the weights it replaces and an
   in-place delete (engines/onnx_proto.py). The two graphs' bytes must be equal.
3. int8_weights.prepared (the widened weights a session gets on CPUs whose u8 x s8 product saturates),
   old clear-and-extend against the in-place delete; equal bytes.

    python3 benchmarks/int8_search_cpu.py --rounds 5

Prints medians (ms) and old / new ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _old_drop(graph, unwanted) -> int:
    keep = [i for i in graph.initializer if not unwanted(i)]
    gone = len(graph.initializer) - len(keep)
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return gone


def _old_copy(model, skip_initializers=frozenset()):
    import onnx

    return onnx.ModelProto.FromString(model.SerializeToString())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calibration", type=int, default=128, help="calibration sentences for the moments")
    args = ap.parse_args(argv)

    import onnx_ir as ir

    from surge.data import calibration_queries
    from surge.engines import int8_weights, onnx_proto
    from surge.models import bundled_model_dir, load_model_spec
    from surge.optimize import rowquant
    from surge.optimize.export import ensure_exported
    from surge.optimize.gptq import feedback_factor, gptq_weights, input_moments
    from surge.optimize.passes import PassContext, graph_passes, run_passes
    from surge.optimize.smooth import activation_absmax, smooth
    from surge.optimize.validate import Encoded

    spec = load_model_spec(bundled_model_dir())
    graph = ir.load(str(ensure_exported(spec, ROOT / ".surge-cache") / "model.onnx"))
    run_passes(graph, graph_passes(), PassContext(spec.num_heads, spec.hidden_size))
    fused = ir.serde.serialize_model(graph)
    batches = Encoded(spec, calibration_queries()[:args.calibration]).batches
    smoothed, _ = smooth(fused, activation_absmax(fused, batches, threads=2), 0.65)
    rows = []

    # 1. the feedback factor, on the real moments of each input width
    nodes = [n for n in rowquant.quantizable(smoothed) if n.name]
    moments = input_moments(smoothed, batches, {n.input[0] for n in nodes}, threads=2)
    by_width = {}
    for h in moments.values():
        by_width.setdefault(h.shape[0], h)
    for k, h in sorted(by_width.items()):
        h = h + 0.01 * float(np.mean(np.diag(h))) * np.eye(k)
        old = np.linalg.cholesky(np.linalg.inv(h)).T
        new = feedback_factor(h)
        err = float(np.abs(old - new).max() / np.abs(old).max())
        rows.append((f"GPTQ factor, K = {k}", _median_ms(lambda h=h: np.linalg.cholesky(np.linalg.inv(h)).T, args.rounds),
                     _median_ms(lambda h=h: feedback_factor(h), args.rounds), f"max rel. diff {err:.1e}"))

    # 2. quantize_rows (GPTQ weights, as the search converts the model at each fallback step)
    weights = gptq_weights(smoothed, batches, threads=2)

    def quantize():
        return rowquant.quantize_rows(smoothed, weights=weights)[0]

    new_model = quantize()
    new_ms = _median_ms(quantize, args.rounds)
    saved = rowquant.copy_model, rowquant.drop_initializers
    rowquant.copy_model, rowquant.drop_initializers = _old_copy, _old_drop
    try:
        old_model = quantize()
        old_ms = _median_ms(quantize, args.rounds)
    finally:
        rowquant.copy_model, rowquant.drop_initializers = saved
    same = old_model.SerializeToString() == new_model.SerializeToString()
    rows.append(("quantize_rows", old_ms, new_ms, f"bytes equal: {same}"))

    # 3. the widened weights a session is given (forced on: SURGE_INT8_WEIGHTS=u8)
    import os

    os.environ["SURGE_INT8_WEIGHTS"] = "u8"
    data = new_model.SerializeToString()
    new_bytes = int8_weights.prepared(data)
    new_ms = _median_ms(lambda: int8_weights.prepared(data), args.rounds)
    saved = onnx_proto.drop_initializers
    onnx_proto.drop_initializers = _old_drop
    try:
        old_bytes = int8_weights.prepared(data)
        old_ms = _median_ms(lambda: int8_weights.prepared(data), args.rounds)
    finally:
        onnx_proto.drop_initializers = saved
    rows.append(("prepared (widened weights)", old_ms, new_ms, f"bytes equal: {old_bytes == new_bytes}"))

    print(f"bundled MiniLM, {args.calibration} calibration sentences, median of {args.rounds} (ms)")
    print("| part | old | new | old / new | check |\n| --- | ---: | ---: | ---: | --- |")
    for name, old, new, note in rows:
        print(f"| {name} | {old:.1f} | {new:.1f} | {old / new:.2f}x | {note} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
