"""The pass contract: an in-place transformation of an onnx-ir model that says what it did.

Every pass returns a PassReport with the node and op-type counts before and
after and free-form details, which `surge optimize --explain` prints and the
manifest records.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnx_ir as ir


def op_counts(model: ir.Model) -> Counter:
    """Op types of the main graph, keyed "domain::Op" for non-default domains."""
    counts: Counter = Counter()
    for node in model.graph:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[key] += 1
    return counts


@dataclass
class PassContext:
    """What passes may need to know about the model beyond its graph."""

    num_heads: int = 0
    hidden_size: int = 0  # attention width, num_heads x head size (less than the model's when pruned)
    target: str = "cpu"  # cpu | gpu
    user_rules: list[str] = field(default_factory=list)  # import paths of extra rewrite rules


@dataclass
class PassReport:
    name: str
    nodes_before: int
    nodes_after: int
    ops_before: dict
    ops_after: dict
    details: list[str] = field(default_factory=list)
    changes: int = 0  # rewrites, fusions or removals the pass counted itself

    @property
    def op_delta(self) -> dict:
        keys = set(self.ops_before) | set(self.ops_after)
        delta = {k: self.ops_after.get(k, 0) - self.ops_before.get(k, 0) for k in keys}
        return {k: v for k, v in sorted(delta.items()) if v}

    def to_json(self) -> dict:
        return {"name": self.name, "changes": self.changes, "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "op_delta": self.op_delta, "details": self.details}


class GraphPass:
    """Subclasses set `name`, `description` and implement `transform`."""

    name = "pass"
    description = ""

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        """Change `model` in place; return (number of changes, details)."""
        raise NotImplementedError

    def __call__(self, model: ir.Model, ctx: PassContext) -> PassReport:
        before = op_counts(model)
        changes, details = self.transform(model, ctx)
        after = op_counts(model)
        return PassReport(self.name, sum(before.values()), sum(after.values()), dict(before), dict(after),
                          details, changes)
