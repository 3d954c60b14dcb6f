"""A user rewrite rule loaded by import path in the tests. It is deliberately WRONG
(erf is not tanh): the accuracy gate must catch what it does to the numbers."""

from onnxscript.rewriter import RewriteRuleClassBase


class ErfToTanh(RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.Erf(x)

    def rewrite(self, op, x):
        return op.Tanh(op.Mul(x, op.Constant(value_float=3.0)))


erf_to_tanh = ErfToTanh.rule()
