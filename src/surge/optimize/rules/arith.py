"""Arithmetic with constants: cheaper forms of the same math.

- Div(x, c) -> Mul(x, 1/c) for a float constant c (a multiply is cheaper than a
  divide; exact when c is a power of two, otherwise within one rounding).
- Mul(Mul(x, a), b) -> Mul(x, a*b) and Add(Add(x, a), b) -> Add(x, a+b) for
  scalar constants: one pass over the tensor instead of two.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleClassBase
from onnxscript.rewriter import _ir_utils as ir_utils
from onnxscript.rewriter._basics import MatchResult

_FLOATS = (np.float32, np.float64, np.float16)


def _const(value: ir.Value) -> np.ndarray | None:
    array = ir_utils.get_numpy_value(value)
    if array is None or array.dtype.type not in _FLOATS:
        return None
    return array


class DivByConstant(RewriteRuleClassBase):
    def __init__(self):
        super().__init__("DivByConstantToMul")

    def pattern(self, op, x, c):
        return op.Div(x, c)

    def check(self, context, x, c) -> MatchResult:
        result = MatchResult()
        array = _const(c)
        if array is None or array.size != 1 or not np.isfinite(array).all() or (array == 0).any():
            return result.fail("divisor is not a finite non-zero float scalar constant")
        return result

    def rewrite(self, op, x, c):
        array = _const(c)
        inverse = (1.0 / array.astype(np.float64)).astype(array.dtype)
        return op.Mul(x, op.Constant(value=ir.tensor(inverse)))


class _ChainedScalar(RewriteRuleClassBase):
    op_type = ""

    def pattern(self, op, x, a, b):
        inner = getattr(op, self.op_type)(x, a)
        return getattr(op, self.op_type)(inner, b)

    def check(self, context, x, a, b) -> MatchResult:
        result = MatchResult()
        va, vb = _const(a), _const(b)
        if va is None or vb is None or va.size != 1 or vb.size != 1 or va.dtype != vb.dtype:
            return result.fail("not two float scalar constants of one dtype")
        return result

    def rewrite(self, op, x, a, b):
        va, vb = _const(a), _const(b)
        combined = va * vb if self.op_type == "Mul" else va + vb
        # Keep the higher rank of the two so broadcasting gives the same shape.
        combined = combined.reshape(va.shape if va.ndim >= vb.ndim else vb.shape).astype(va.dtype)
        return getattr(op, self.op_type)(x, op.Constant(value=ir.tensor(combined)))


class MulMulConstants(_ChainedScalar):
    op_type = "Mul"

    def __init__(self):
        super().__init__("MulMulConstants")


class AddAddConstants(_ChainedScalar):
    op_type = "Add"

    def __init__(self):
        super().__init__("AddAddConstants")


def rules():
    return [DivByConstant.rule(), MulMulConstants.rule(), AddAddConstants.rule()]
