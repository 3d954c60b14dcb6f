"""A user rewrite rule loaded by import path in the tests. It is deliberately WRONG
(erf is not tanh): the accuracy gate must catch what it does to the numbers."""

from onnxscript.rewriter import RewriteRuleClassBase


class ErfToTanh(RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.Erf(x)

    def rewrite(self, op, x):
        return op.Tanh(op.Mul(x, op.Constant(value_float=3.0)))


erf_to_tanh = ErfToTanh.rule()


class FlipMatMul(RewriteRuleClassBase):
    """MatMul(a, b) -> MatMul(a, -b) where b is a weight: obviously wrong, drastically so."""

    def pattern(self, op, a, b):
        return op.MatMul(a, b)

    def check(self, context, a, b):
        from onnxscript.rewriter._basics import MatchResult

        result = MatchResult()
        if b.const_value is None:
            return result.fail("not a weight")
        return result

    def rewrite(self, op, a, b):
        return op.MatMul(a, op.Neg(b))


flip_matmul = FlipMatMul.rule()
