"""Pattern rewrites with onnxscript's rewriter: its default rules, surge's library and users' rules.

Rules are applied one at a time to a fixed point so the report can say how
often each one fired.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import rewriter
from onnxscript.rewriter import RewriteRuleSet

from surge.optimize.passes.base import GraphPass, PassContext

_MAX_ROUNDS = 4


class RewriteRules(GraphPass):
    name = "rewrite_rules"
    description = "onnxscript default rules + surge.optimize.rules + --rule import paths"

    def rules(self, ctx: PassContext):
        from surge.optimize.rules import default_rules, load_user_rules

        user = [r for path in ctx.user_rules for r in load_user_rules(path)]
        return [*rewriter._DEFAULT_REWRITE_RULES, *default_rules(), *user]

    def transform(self, model: ir.Model, ctx: PassContext) -> tuple[int, list[str]]:
        rules = self.rules(ctx)
        fired: dict[str, int] = {}
        for _ in range(_MAX_ROUNDS):
            changed = 0
            for rule in rules:
                count = RewriteRuleSet([rule]).apply_to_model(model)
                if count:
                    name = rule.name or _describe(rule)
                    fired[name] = fired.get(name, 0) + count
                    changed += count
            if not changed:
                break
        ir.passes.common.RemoveUnusedNodesPass()(model)
        details = [f"{name}: {count}x" for name, count in sorted(fired.items())] or ["no rule matched"]
        return sum(fired.values()), details


def _describe(rule) -> str:
    """A name for onnxscript's unnamed rules: the pattern they match, on one line."""
    text = " ".join(str(getattr(rule, "_target_pattern", "")).split())
    import re

    body = text.split("{", 1)[-1].rsplit("return", 1)[0].strip()
    body = re.sub(r"^\S+ = ", "", body)  # drop the anonymous output name
    return f"onnxscript rule [{body[:60]}]" if body else "onnxscript rule"
