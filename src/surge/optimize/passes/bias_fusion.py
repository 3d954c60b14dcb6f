"""Fold the bias Add that follows a MatMul into the Gelu and SkipLayerNormalization after it.

BiasGelu(x, b) and SkipLayerNormalization(x, skip, gamma, beta, bias) read the
bias directly, so the separate Add (a full pass over the activations) goes.
"""

from __future__ import annotations

import onnx_ir as ir

from surge.optimize.passes._ort_bridge import fused_count, replace_in_place, run_ort_fusions
from surge.optimize.passes.base import GraphPass, PassContext


class BiasFusion(GraphPass):
    name = "bias_fusion"
    description = "MatMul bias Add + Gelu -> BiasGelu; bias Add + SkipLayerNormalization -> one op"

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        from onnxruntime.transformers.fusion_biasgelu import FusionBiasGelu
        from onnxruntime.transformers.fusion_skiplayernorm import FusionBiasSkipLayerNormalization

        def steps(bert):
            FusionBiasGelu(bert, True).apply()
            FusionBiasGelu(bert, False).apply()
            FusionBiasSkipLayerNormalization(bert).apply()

        before_add = fused_count(model, "Add")
        new = run_ort_fusions(model, steps)
        gelu = fused_count(new, "BiasGelu") + fused_count(new, "FastGelu") - fused_count(model, "BiasGelu") - fused_count(model, "FastGelu")
        removed = before_add - fused_count(new, "Add")
        replace_in_place(model, new)
        return removed, [f"{gelu} Gelu took their bias ({removed} bias Adds folded into Gelu/SkipLayerNormalization)"]
