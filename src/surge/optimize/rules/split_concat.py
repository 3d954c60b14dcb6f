"""Split + Concat chains, as exporters write them for chunk/cat and repeat_interleave.

- Concat(Split(x)) with the pieces in order along the same axis is x.
- Concat(s0, s0, s1, s1, ...) of an equal Split along axis a (repeat_interleave
  by 2 on blocks) is Reshape(x) to [..., n, k, ...] + Expand to [..., n, 2, k, ...]
  + Reshape back: one copy instead of n slices and a gather-like concat.
- Concat(x, x, ..., x) along a is Tile(x).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleClassBase
from onnxscript.rewriter._basics import MatchResult


def _axis(node: ir.Node, rank: int) -> int:
    axis = node.attributes.get_int("axis", 0)
    return axis + rank if axis < 0 else axis


def _split_is_equal(split: ir.Node, x: ir.Value, axis: int, n: int) -> bool:
    dim = x.shape[axis] if x.shape is not None else None
    if not isinstance(dim, int) or dim % n:
        return False
    if len(split.inputs) > 1 and split.inputs[1] is not None:
        sizes = split.inputs[1].const_value
        return sizes is not None and len(set(sizes.numpy().tolist())) == 1
    return True  # num_outputs attribute: equal pieces when the dim divides


class SplitConcatIdentity(RewriteRuleClassBase):
    """Concat(*Split(x, axis=a), axis=a) -> x."""

    def __init__(self, n: int):
        super().__init__(f"SplitConcatIdentity{n}")
        self.n = n

    def pattern(self, op, x):
        parts = op.Split(x, _allow_other_inputs=True, _outputs=[f"s{i}" for i in range(self.n)])
        return op.Concat(*parts)

    def check(self, context, x, **parts) -> MatchResult:
        result = MatchResult()
        if x.shape is None:
            return result.fail("rank of x unknown")
        split, concat = parts["s0"].producer(), context.root
        rank = len(x.shape)
        # The matcher binds outputs by position only: make sure the Concat reads
        # every output of this very Split, once, in order.
        if list(concat.inputs) != list(split.outputs):
            return result.fail("concat does not read the split's outputs in order")
        if _axis(split, rank) != _axis(concat, rank):
            return result.fail("split and concat axes differ")
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


class SplitConcatInterleave(RewriteRuleClassBase):
    """Concat(s0, s0, s1, s1, ..) over an equal n-way Split of x -> Reshape + Expand + Reshape."""

    def __init__(self, n: int):
        super().__init__(f"SplitConcatInterleave{n}")
        self.n = n

    def pattern(self, op, x):
        parts = op.Split(x, _allow_other_inputs=True, _outputs=[f"s{i}" for i in range(self.n)])
        doubled = [p for p in parts for _ in range(2)]
        return op.Concat(*doubled)

    def check(self, context, x, **parts) -> MatchResult:
        result = MatchResult()
        if x.shape is None or not all(isinstance(d, int) for d in x.shape):
            return result.fail("needs a static shape")
        split, concat = parts["s0"].producer(), context.root
        rank = len(x.shape)
        if list(concat.inputs) != [o for o in split.outputs for _ in range(2)]:
            return result.fail("concat does not read each split output twice, in order")
        axis = _axis(split, rank)
        if axis != _axis(concat, rank) or not _split_is_equal(split, x, axis, self.n):
            return result.fail("not an equal split along the concat axis")
        return result

    def rewrite(self, op, x, **parts):
        split = parts["s0"].producer()
        return _interleave(op, x, self.n, list(x.shape), _axis(split, len(x.shape)))


def _interleave(op, x, n: int, dims: list[int], axis: int):
    k = dims[axis] // n
    blocks = dims[:axis] + [n, 1, k] + dims[axis + 1 :]
    expanded = dims[:axis] + [n, 2, k] + dims[axis + 1 :]
    merged = dims[:axis] + [2 * dims[axis]] + dims[axis + 1 :]
    r = op.Reshape(x, op.Constant(value=ir.tensor(np.array(blocks, np.int64))))
    e = op.Expand(r, op.Constant(value=ir.tensor(np.array(expanded, np.int64))))
    return op.Reshape(e, op.Constant(value=ir.tensor(np.array(merged, np.int64))))


class ConcatRepeatToTile(RewriteRuleClassBase):
    """Concat(x, x, .., x, axis=a) -> Tile(x, repeats with r at a)."""

    def __init__(self, r: int):
        super().__init__(f"ConcatRepeatToTile{r}")
        self.r = r

    def pattern(self, op, x):
        return op.Concat(*([x] * self.r))

    def check(self, context, x) -> MatchResult:
        result = MatchResult()
        if x.shape is None:
            return result.fail("rank of x unknown")
        self._concat_axis = _axis(context.root, len(x.shape))  # read back by rewrite()
        return result

    def rewrite(self, op, x):
        repeats = np.ones(len(x.shape), np.int64)
        repeats[self._concat_axis] = self.r
        return op.Tile(x, op.Constant(value=ir.tensor(repeats)))


def rules():
    return ([SplitConcatIdentity.rule(n) for n in (2, 3, 4)]
            + [SplitConcatInterleave.rule(n) for n in (2, 3, 4)]
            + [ConcatRepeatToTile.rule(r) for r in (2, 3, 4)])
