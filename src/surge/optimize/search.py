"""Automatic block-list search: the fewest op types kept in FP32 that meet the accuracy budget.

1. Sensitivity: for each candidate op type, convert *only* that type to low
   precision and measure 1 - mean cosine against FP32 on calibration text.
2. Greedy: start from an empty block list; while the budget is missed, block
   the most sensitive op type not yet blocked and measure again.

Measuring op types one at a time costs one evaluation each; the greedy walk
stops at the first list that passes, so the result is the smallest prefix of
the sensitivity order that meets the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from surge.optimize.validate import Budget, GateResult, SetMetrics, check


@dataclass
class SearchResult:
    block_list: list[str]
    passed: bool
    sensitivity: dict[str, float]  # op type -> 1 - mean cosine when only it is low precision
    steps: list[dict] = field(default_factory=list)  # each tried block list and its calibration metrics

    def to_json(self) -> dict:
        return {"block_list": self.block_list, "passed": self.passed, "sensitivity": self.sensitivity,
                "steps": self.steps}


def search_block_list(candidates: list[str], measure: Callable[[list[str]], SetMetrics], budget: Budget,
                      progress: Callable[[str], None] | None = None,
                      all_op_types: list[str] | None = None) -> SearchResult:
    """`measure(block_list)` converts with that block list and returns calibration metrics.

    `all_op_types`: every op type of the graph; to isolate one candidate, all
    the others are blocked (plumbing ops such as Gather included).
    """
    say = progress or (lambda _: None)
    universe = sorted(set(all_op_types or candidates) | set(candidates))
    sensitivity = {}
    for op in candidates:
        say(f"sensitivity of {op}")
        metrics = measure([c for c in universe if c != op])
        sensitivity[op] = round(1.0 - metrics.mean_cosine, 9)
    order = sorted(candidates, key=lambda op: sensitivity[op], reverse=True)
    steps = []
    block: list[str] = []
    for i in range(len(order) + 1):
        block = order[:i]
        say(f"trying block list {block or '[]'}")
        metrics = measure(block)
        gate: GateResult = check(budget, {"calibration": metrics})
        steps.append({"block_list": block, "metrics": metrics.to_json(), "passed": gate.passed})
        if gate.passed:
            return SearchResult(block, True, sensitivity, steps)
    return SearchResult(block, False, sensitivity, steps)
