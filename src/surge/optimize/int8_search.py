"""`--precision int8` decisions, each measured on the calibration sentences.

1. Smoothing strength: if plain INT8 meets the budget on the calibration
   sentences it is kept (smoothing adds a Mul per MatMul it cannot fold).
   Otherwise quantize with SmoothQuant migration at each alpha of a small grid
   and keep the one with the highest calibration mean cosine (a continuous
   metric: the top-1 agreement moves in steps of 1/N and would pick by noise).
2. FP32 fallback: if the calibration set still misses the budget, measure
   every quantized node's sensitivity (the calibration mean cosine gained by
   keeping only that node in FP32) and keep nodes in FP32 in that order until
   the budget is met. At most `max_fp32_fraction` of the nodes may stay FP32:
   past that the artifact is no longer an INT8 model, and the final gate
   (calibration and held-out) refuses it.

The held-out sentences are never looked at here; the pipeline's gate checks
them afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx

from surge.optimize.quantize import quantize_int8
from surge.optimize.smooth import activation_absmax, smooth, weighted_nodes
from surge.optimize.validate import Budget, Evaluator, SetMetrics, check

ALPHAS = (0.5, 0.65, 0.8, 0.9)


@dataclass
class Int8Plan:
    model: onnx.ModelProto
    alpha: float | None  # None: no smoothing
    kept_fp32: list[str]
    calibration_passed: bool
    info: dict = field(default_factory=dict)


def build_int8(proto: onnx.ModelProto, evaluator: Evaluator, budget: Budget, per_channel: bool = True,
               alpha: float | None | str = "auto", search: bool = True, max_fp32_fraction: float = 0.25,
               progress: Callable[[str], None] | None = None) -> Int8Plan:
    """alpha: "auto" (measured grid), None (no smoothing) or a fixed value in (0, 1]."""
    say = progress or (lambda _: None)
    calibration = evaluator.data["calibration"]

    def measure(model: onnx.ModelProto) -> SetMetrics:
        return evaluator.metrics(model.SerializeToString(), sets=("calibration",))["calibration"]

    say("int8: measuring activation ranges on the calibration sentences")
    absmax = activation_absmax(proto, calibration.batches, evaluator.threads)
    alphas = [None, *ALPHAS] if alpha == "auto" else [alpha]
    tried = []
    best = None
    for a in alphas:
        say(f"int8: smoothing alpha {a if a is not None else 'off'}")
        smoothed, sinfo = smooth(proto, absmax, a) if a is not None else (proto, None)
        q, qinfo = quantize_int8(smoothed, per_channel=per_channel)
        m = measure(q)
        tried.append({"alpha": a, "mean_cosine": round(m.mean_cosine, 6), "top1_tie": m.top1_tie})
        if best is None or m.mean_cosine > best[3].mean_cosine:
            best = (a, smoothed, sinfo, m, q, qinfo)
        if a is None and alpha == "auto" and check(budget, {"calibration": m}).passed:
            break  # plain INT8 already meets the budget: no smoothing Muls (fewer nodes, faster)
    a, smoothed, sinfo, metrics, q, qinfo = best
    info: dict = {"smoothing": sinfo.to_json() if sinfo else {"alpha": None},
                  "alpha_search": tried if len(tried) > 1 else None}
    kept: list[str] = []
    passed = check(budget, {"calibration": metrics}).passed
    steps = [{"kept_fp32": [], "mean_cosine": round(metrics.mean_cosine, 6), "top1_tie": metrics.top1_tie, "passed": passed}]
    if not passed and search:
        names = [n.name for n in weighted_nodes(smoothed) if n.name]
        limit = int(max_fp32_fraction * len(names))
        sensitivity = {}
        for i, name in enumerate(names):
            say(f"int8: sensitivity of {name} ({i + 1}/{len(names)})")
            sensitivity[name] = round(measure(quantize_int8(smoothed, per_channel, exclude=[name])[0]).mean_cosine
                                      - metrics.mean_cosine, 9)
        order = sorted(names, key=lambda n: sensitivity[n], reverse=True)
        info["sensitivity"] = {n: sensitivity[n] for n in order}
        for name in order[:limit]:
            kept.append(name)
            say(f"int8: keeping {len(kept)} node(s) in FP32")
            q, qinfo = quantize_int8(smoothed, per_channel, exclude=kept)
            metrics = measure(q)
            passed = check(budget, {"calibration": metrics}).passed
            steps.append({"kept_fp32": list(kept), "mean_cosine": round(metrics.mean_cosine, 6),
                          "top1_tie": metrics.top1_tie, "passed": passed})
            if passed:
                break
        info["max_fp32"] = limit
    info["fallback_steps"] = steps
    qinfo.update(info)
    return Int8Plan(q, a, kept, passed, qinfo)
