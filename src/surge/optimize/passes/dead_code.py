"""Dead-code elimination on onnx-ir: unused nodes, initializers, functions and opset imports."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common

from surge.optimize.passes.base import GraphPass, PassContext


class DeadCodeElimination(GraphPass):
    name = "dead_code"
    description = "remove nodes and initializers no output depends on (onnx_ir RemoveUnused*Pass)"

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        nodes, inits = len(model.graph), len(model.graph.initializers)
        common.IdentityEliminationPass()(model)
        common.RemoveUnusedNodesPass()(model)
        common.RemoveUnusedFunctionsPass()(model)
        common.RemoveUnusedOpsetsPass()(model)
        removed_nodes = nodes - len(model.graph)
        removed_inits = inits - len(model.graph.initializers)
        return removed_nodes + removed_inits, [f"removed {removed_nodes} nodes, {removed_inits} initializers"]
