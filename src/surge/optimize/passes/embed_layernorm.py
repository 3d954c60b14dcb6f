"""Word + position + token-type embedding Gathers, their Adds and the LayerNorm -> EmbedLayerNormalization.

The fused op also turns the attention mask into the mask index the Attention
ops read, so it runs after attention fusion.
"""

from __future__ import annotations

import onnx_ir as ir

from surge.optimize.passes._ort_bridge import fused_count, replace_in_place, run_ort_fusions
from surge.optimize.passes.base import GraphPass, PassContext


class EmbedLayerNormFusion(GraphPass):
    name = "embed_layernorm"
    description = "embedding lookups + Add + LayerNormalization -> EmbedLayerNormalization"

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        from onnxruntime.transformers.fusion_embedlayer import FusionEmbedLayerNormalization

        def steps(bert):
            FusionEmbedLayerNormalization(bert, use_mask_index=False).apply()

        new = run_ort_fusions(model, steps)
        n = fused_count(new, "EmbedLayerNormalization") - fused_count(model, "EmbedLayerNormalization")
        replace_in_place(model, new)
        return n, [f"fused {n} EmbedLayerNormalization"]
