"""Add + LayerNormalization (the residual) -> com.microsoft SkipLayerNormalization."""

from __future__ import annotations

import onnx_ir as ir

from surge.optimize.passes._ort_bridge import fused_count, replace_in_place, run_ort_fusions
from surge.optimize.passes.base import GraphPass, PassContext


class SkipLayerNormFusion(GraphPass):
    name = "skip_layernorm"
    description = "residual Add + LayerNormalization -> SkipLayerNormalization"

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        from onnxruntime.transformers.fusion_skiplayernorm import FusionSkipLayerNormalization

        def steps(bert):
            bert.preprocess()  # drops empty Reshapes the matcher would trip over
            FusionSkipLayerNormalization(bert, shape_infer=True).apply()

        new = run_ort_fusions(model, steps)
        n = fused_count(new, "SkipLayerNormalization") - fused_count(model, "SkipLayerNormalization")
        replace_in_place(model, new)
        return n, [f"fused {n} SkipLayerNormalization"]
