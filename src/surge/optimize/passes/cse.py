"""Common-subexpression elimination on onnx-ir: identical nodes on identical inputs computed once.

Also merges initializers holding the same bytes (tied embeddings, repeated
shape constants), which is what lets CSE see the nodes reading them as equal.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common

from surge.optimize.passes.base import GraphPass, PassContext


class CommonSubexpressionElimination(GraphPass):
    name = "cse"
    description = "merge duplicate initializers and nodes (onnx_ir CommonSubexpressionEliminationPass)"

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        nodes, inits = len(model.graph), len(model.graph.initializers)
        common.DeduplicateInitializersPass(size_limit=1 << 20)(model)
        common.CommonSubexpressionEliminationPass(size_limit=1 << 20)(model)
        common.RemoveUnusedNodesPass()(model)
        merged_nodes = nodes - len(model.graph)
        merged_inits = inits - len(model.graph.initializers)
        return merged_nodes + merged_inits, [f"merged {merged_nodes} duplicate nodes, {merged_inits} duplicate initializers"]
