"""The default INT8 plan on held-out queries, measured by the gate as it serves: every sentence within cosine
0.99 of FP32, strict retrieval top-1 (queries over disjoint documents, serving layout) computed as defined,
and the outlier split bringing it closer to FP32 than plain per-row INT8 and than the FP32 fallback it replaced.

The plan (SmoothQuant alpha, each node's OUTLIER_CHANNELS largest input channels in FP32, GPTQ weights rounded
for that split, no node kept in FP32) is what `surge optimize --precision int8` chose with default settings
on the shipped calibration queries (its search takes minutes on 2 cores; whole-corpus numbers in
docs/benchmarks/optimizer.md, Issue 21 session 7: strict top-1 0.985 [0.980, 0.989] on all 2,715 held-out
queries, where session 2's plan with six nodes in FP32 had 0.982 [0.976, 0.986]). Rebuilt here the way the
search builds it, on fewer calibration and held-out queries to keep the test short. Whether strict top-1
clears 0.98 sits inside its interval, so the number is printed, and the gate's arithmetic and verdict are
what is asserted.
"""

from __future__ import annotations

import numpy as np
import pytest

from surge.data import calibration_queries, heldout_queries
from surge.optimize.gptq import gptq_weights, node_moments
from surge.optimize.int8_search import OUTLIER_CHANNELS
from surge.optimize.rowquant import outlier_channels, quantize_rows
from surge.optimize.smooth import activation_absmax, smooth
from surge.optimize.validate import (
    BUDGETS,
    Encoded,
    Evaluator,
    check,
    compare,
    run_model,
    session,
)

ALPHA = 0.65
# Session 2's plan: these six nodes kept in FP32 (the fallback the outlier split replaced).
KEPT_FP32 = ["Attention_5", "Attention_4", "/model/encoder/layer.4/intermediate/dense/MatMul", "Attention_3",
             "/model/encoder/layer.0/output/dense/MatMul", "/model/encoder/layer.3/output/dense/MatMul"]
CALIBRATION, HELDOUT = 256, 1200


@pytest.fixture(scope="module")
def bundled_export(bundled_artifact):
    return bundled_artifact / "model.onnx"


@pytest.fixture(scope="module")
def plan(bundled_export, bundled_spec):
    """The bundled model after `surge optimize`'s graph passes, smoothed; its outlier channels; GPTQ weights
    for that split, and plain GPTQ weights (for the plans it is compared with)."""
    import onnx_ir as ir

    from surge.optimize.passes import PassContext, graph_passes, run_passes

    graph = ir.load(str(bundled_export))
    run_passes(graph, graph_passes(), PassContext(bundled_spec.num_heads, bundled_spec.hidden_size))
    fused = ir.serde.serialize_model(graph)
    calibration = Encoded(bundled_spec, calibration_queries()[:CALIBRATION])
    smoothed, _ = smooth(fused, activation_absmax(fused, calibration.batches, threads=2), ALPHA)
    outliers = outlier_channels(smoothed, activation_absmax(smoothed, calibration.batches, threads=2), OUTLIER_CHANNELS)
    moments = node_moments(smoothed, calibration.batches, threads=2)  # both roundings read the same moments
    return (smoothed, outliers, gptq_weights(smoothed, calibration.batches, threads=2, outliers=outliers, moments=moments),
            gptq_weights(smoothed, calibration.batches, threads=2, moments=moments))


def test_default_plan_on_heldout_queries_strict_top1_and_every_sentence(plan, bundled_spec, bundled_export):
    smoothed, outliers, weights, plain_weights = plan
    model, info = quantize_rows(smoothed, weights=weights, outliers=outliers)
    assert info["unsigned_gelu_inputs"] == 6 and sum(info["quantized_ops"].values()) == 24 and not info["kept_fp32"]
    assert info["outlier_channels"] == {"nodes": 24, "per_node": [OUTLIER_CHANNELS], "computed_in": "fp32"}
    ev = Evaluator(bundled_spec, bundled_export, calibration_queries()[:8], heldout_queries()[:HELDOUT], threads=2)
    assert ev.data["heldout"].layout == "serving"  # mixed lengths, batch sizes 1-64
    out = run_model(session(model.SerializeToString(), 2), bundled_spec, ev.data["heldout"])
    m = compare(ev.reference["heldout"], out)  # what the gate computes
    assert m.n == HELDOUT and m.min_cosine >= 0.99, m.worst  # every sentence, not the mean
    # Strict top-1 as defined: each third of the queries over the other two thirds as documents, float64.
    ref = ev.reference["heldout"].embeddings.astype(np.float64)
    cand = out.embeddings.astype(np.float64)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    cand /= np.linalg.norm(cand, axis=1, keepdims=True)
    hits = []
    for part in np.array_split(np.arange(HELDOUT), 3):
        docs = np.setdiff1d(np.arange(HELDOUT), part)
        hits += [docs[np.argmax(ref[docs] @ ref[q])] == docs[np.argmax(cand[docs] @ cand[q])] for q in part]
    assert np.isclose(m.top1, np.mean(hits)) and m.top1_tie >= m.top1 > 0.95
    lo, hi = m.top1_ci95
    assert lo <= m.top1 <= hi and hi - lo < 0.03
    gate = check(BUDGETS["int8"], {"heldout": m})
    assert gate.passed == (m.top1 >= 0.98 and m.min_cosine >= 0.99 and m.top1_tie >= 0.98 and m.mean_cosine >= 0.99)
    print(f"held-out {HELDOUT}: strict top-1 {m.top1:.4f} [{lo:.4f}, {hi:.4f}], min cos {m.min_cosine:.5f}")
    # Without the split, per-row INT8 is further from FP32: the split does what it was chosen for; and it is
    # closer than session 2's plan, which kept six whole nodes in FP32 instead.
    others = {name: ev.metrics(quantize_rows(smoothed, exclude=kept, weights=plain_weights)[0].SerializeToString(),
                               sets=("heldout",))["heldout"] for name, kept in (("plain", []), ("fallback", KEPT_FP32))}
    for other in others.values():
        assert other.mean_cosine < m.mean_cosine and other.min_cosine < m.min_cosine
