"""Constant folding with onnxscript's optimizer: nodes whose inputs are all known become initializers.

It also propagates shapes, which turns the exporter's Shape->Gather->Unsqueeze
chains on static dims into constants. Folded values are size-limited so that a
broadcast never materializes a huge tensor.
"""

from __future__ import annotations

import onnx_ir as ir

from surge.optimize.passes.base import GraphPass, PassContext


class ConstantFolding(GraphPass):
    name = "constant_folding"
    description = "evaluate nodes whose inputs are constants (onnxscript.optimizer.fold_constants)"

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        from onnxscript.optimizer import fold_constants

        before = len(model.graph)
        result = fold_constants(model, onnx_shape_inference=False, input_size_limit=1 << 20,
                                output_size_limit=1 << 22)
        # Folding leaves the replaced nodes unused; DCE here so counts mean something.
        ir.passes.common.RemoveUnusedNodesPass()(model)
        # Constant nodes become initializers: the runtime loads them once, and
        # the node count then counts computation only.
        ir.passes.common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        folded = before - len(model.graph)
        return max(folded, 0), [f"folded {folded} nodes into constants" + ("" if result.modified else " (no change)")]
