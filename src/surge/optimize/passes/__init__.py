"""Graph passes, one per file; `graph_passes()` is the order `surge optimize` runs them in.

The cleanup passes (folding, rewrites, CSE, DCE) use standard ONNX ops only;
the fusions write ONNX Runtime contrib ops and run only where ORT will execute
the graph (the CPU engine). The order matters: attention fusion matches the
SkipLayerNormalization a layer starts from, the embedding fusion produces the
mask index the Attention ops read, and the bias folds come last.
"""

from __future__ import annotations

import onnx_ir as ir

from surge.optimize.passes.attention_fusion import AttentionFusion
from surge.optimize.passes.base import GraphPass, PassContext, PassReport, op_counts
from surge.optimize.passes.bias_fusion import BiasFusion
from surge.optimize.passes.constant_folding import ConstantFolding
from surge.optimize.passes.cse import CommonSubexpressionElimination
from surge.optimize.passes.dead_code import DeadCodeElimination
from surge.optimize.passes.embed_layernorm import EmbedLayerNormFusion
from surge.optimize.passes.gelu_fusion import GeluFusion
from surge.optimize.passes.rewrite_rules import RewriteRules
from surge.optimize.passes.skip_layernorm import SkipLayerNormFusion

ALL_PASSES: dict[str, type[GraphPass]] = {
    cls.name: cls
    for cls in (ConstantFolding, RewriteRules, CommonSubexpressionElimination, DeadCodeElimination, GeluFusion,
                SkipLayerNormFusion, AttentionFusion, EmbedLayerNormFusion, BiasFusion)
}

CLEANUP = ["constant_folding", "cse", "dead_code"]
FUSIONS = ["gelu_fusion", "skip_layernorm", "attention_fusion", "embed_layernorm", "bias_fusion"]
# The rewrite rules run after the fusions: ORT's matchers expect the exporter's
# own spelling (a Div by sqrt(d), say), which a rule would otherwise change.
FINISH = ["rewrite_rules", "cse", "dead_code"]


def graph_passes(fuse: bool = True) -> list[str]:
    return CLEANUP + (FUSIONS if fuse else []) + FINISH


def run_passes(model: ir.Model, names: list[str], ctx: PassContext, on_pass=None) -> list[PassReport]:
    """Apply the named passes in order; `on_pass(report)` after each."""
    reports = []
    for name in names:
        report = ALL_PASSES[name]()(model, ctx)
        reports.append(report)
        if on_pass:
            on_pass(report)
    return reports


__all__ = ["ALL_PASSES", "CLEANUP", "FUSIONS", "GraphPass", "PassContext", "PassReport", "graph_passes",
           "op_counts", "run_passes"]
