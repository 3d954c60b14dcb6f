"""Self-attention (Q/K/V MatMuls, scaled scores, mask, Softmax, context) -> one Attention op.

The three projections are packed into one [H, 3H] weight, which is also what
the INT8 path quantizes (QAttention). On CPU, ONNX Runtime's Attention kernel
skips the padded keys from a mask index instead of adding -inf scores.
"""

from __future__ import annotations

import onnx_ir as ir

from surge.optimize.passes._ort_bridge import fused_count, replace_in_place, run_ort_fusions
from surge.optimize.passes.base import GraphPass, PassContext


class AttentionFusion(GraphPass):
    name = "attention_fusion"
    description = "multi-head self-attention subgraph -> com.microsoft Attention"

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        from onnxruntime.transformers.fusion_attention import AttentionMask, FusionAttention
        from onnxruntime.transformers.fusion_reshape import FusionReshape
        from onnxruntime.transformers.fusion_shape import FusionShape

        def steps(bert):
            # The mask path carries Casts to the type it already has; the
            # matcher wants them gone (needs ORT's symbolic shape inference).
            bert.utils.remove_useless_cast_nodes()
            FusionReshape(bert).apply()
            mask = AttentionMask(bert)
            FusionAttention(bert, ctx.hidden_size, ctx.num_heads, mask).apply()
            FusionShape(bert).apply()

        new = run_ort_fusions(model, steps)
        n = fused_count(new, "Attention") - fused_count(model, "Attention")
        replace_in_place(model, new)
        return n, [f"fused {n} Attention (num_heads={ctx.num_heads}, hidden={ctx.hidden_size})"]
