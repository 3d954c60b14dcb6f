"""Gelu fusion: the erf (or tanh) formula the exporter writes becomes one Gelu/FastGelu op."""

from __future__ import annotations

import onnx_ir as ir

from surge.optimize.passes._ort_bridge import fused_count, replace_in_place, run_ort_fusions
from surge.optimize.passes.base import GraphPass, PassContext


class GeluFusion(GraphPass):
    name = "gelu_fusion"
    description = "0.5*x*(1+erf(x/sqrt2)) -> com.microsoft Gelu; tanh form -> FastGelu"

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        from onnxruntime.transformers.fusion_fastgelu import FusionFastGelu
        from onnxruntime.transformers.fusion_gelu import FusionGelu

        def steps(bert):
            FusionGelu(bert).apply()
            FusionFastGelu(bert).apply()

        new = run_ort_fusions(model, steps)
        gelu, fast = fused_count(new, "Gelu") - fused_count(model, "Gelu"), fused_count(new, "FastGelu") - fused_count(model, "FastGelu")
        replace_in_place(model, new)
        return gelu + fast, [f"fused {gelu} Gelu, {fast} FastGelu"]
