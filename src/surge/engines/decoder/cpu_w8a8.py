"""INT8 products on the CPU (`--generation quantization=w8a8`): compressed-tensors' W8A8 scheme, run with integers.

A CPU decode step is ~80% linear layers and the LM head, and their weights are read from memory once a step
(session 36's profile). With `w8a8` every linear weight and the LM head are INT8, symmetric, one FP32 scale a row
(models/weight_quant.quantize: half BF16's bytes, a quarter of FP32's), and each product quantizes its input one
row at a time (symmetric INT8, the row's largest |x| at 127: "dynamic per token") and multiplies with integers
(oneDNN's quantized linear on weights packed once at load: VNNI / AMX kernels; torch._int_mm where that op is
missing: it repacks the weight every call, 1.7x slower on GPT-2's LM head, benchmarks/cpu_linear_forms.py), so

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n] + bias[n]

with the integer sum exact: a row's output depends on that row alone, never on the batch it is in.

The answers are a W8A8 model's, not the full-precision model's: each weight and each activation row rounded to
8 bits (the tests hold the engine to transformers computing the same W8A8 products; how far a real model's text
moves is not measured here; models with outlier activation channels, LLM.int8's > 6B, lose more). GPT-2 small,
8 streams on a 2-core Zen 4 VM: 2.32x the FP32 engine's tokens/s, 1.24x BF16's (docs/benchmarks/generate.md,
session 37).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from surge.errors import ConfigError
from surge.models.weight_quant import SCALE_SUFFIX, quantize

QMAX = 127.0
_ZP = 128  # oneDNN's quantized linear reads uint8 inputs: the codes shifted by 128, its zero point 128


@dataclass(frozen=True)
class W8A8Weight:
    wq_t: torch.Tensor  # [K, N] int8, the transposed view of the [N, K] codes (torch._int_mm's operand)
    sw: torch.Tensor  # [N] FP32 scales
    packed: object = None  # oneDNN's packed weight, where its quantized linear exists
    zeros: torch.Tensor | None = None  # [N] int64 weight zero points (symmetric: 0), the op's argument

    @property
    def out_features(self) -> int:
        return self.wq_t.shape[1]


@functools.cache
def _onednn():
    """oneDNN's (quantized linear, weight prepack) ops, or (None, None) where this torch lacks them or they do not
    take the arguments used here (they are the ops torch's compiler calls, not a stable API: probed once on a
    small product, which must come out exact, else torch._int_mm serves)."""
    if not torch.backends.mkldnn.is_available():
        return None, None
    op, prepack = (getattr(torch.ops.onednn, n, None) for n in ("qlinear_pointwise", "qlinear_prepack"))
    if op is None or prepack is None:
        return None, None
    try:
        q = torch.arange(-60, 60, dtype=torch.int8).reshape(3, 40)
        x = torch.arange(80, dtype=torch.int16).reshape(2, 40).sub(40)
        y = op((x + _ZP).to(torch.uint8), 1.0, _ZP, prepack(q, [2, 40]), torch.ones(3),
               torch.zeros(3, dtype=torch.int64), None, 1.0, 0, torch.float32, "none", [], "")
        if torch.equal(y.double(), (x.double() @ q.double().T)):
            return op, prepack
    except (RuntimeError, TypeError, ValueError):
        pass
    return None, None


def quantize_weights(weights: dict, names, rows: int = 8) -> dict:
    """name -> W8A8Weight for each of `names`, quantized from its [N, K] weight in the dict's dtype (packed for
    oneDNN's kernels at `rows` rows, the decode step's); the full-precision tensors are dropped from `weights` (a
    tied LM head keeps the embedding, another name for the same storage). A weight that is INT8 already with its
    row scales under name + ".scale" (a W8A8 checkpoint's, models/quantized_checkpoint.py) keeps its codes and
    scales as they are: no second rounding. A ConfigError where this CPU's integer products are not exact (x86
    without VNNI or AMX may saturate int16 pair sums: checked here, on the worst case, not guessed from flags)."""
    out = {name: _weight(weights.pop(name), rows, weights.pop(name + SCALE_SUFFIX, None)) for name in names}
    _check_exact()
    return out


def _weight(w: torch.Tensor, rows: int, scale: torch.Tensor | None = None) -> W8A8Weight:
    if w.dtype == torch.int8 and scale is not None:  # a checkpoint's codes (-128 too: VNNI sums it exactly)
        q, s = w.contiguous(), scale
    else:
        q, s = quantize(w, "int8")
    prepack = _onednn()[1]
    if prepack is None:
        return W8A8Weight(q.t(), s.float())
    return W8A8Weight(q.t(), s.float(), prepack(q, [rows, q.shape[1]]), torch.zeros(q.shape[0], dtype=torch.int64))


def _check_exact() -> None:
    """The largest products the codes allow, summed, against int64 arithmetic (a saturating kernel clips them)."""
    k = 256
    x = torch.full((2, k), QMAX)
    x[1, ::2] = -QMAX
    w = torch.full((3, k), 1.0)
    w[1, 1::2] = -1.0
    w[2] = -1.0
    got = linear(x, _weight(w, 2))
    want = x.double() @ w.double().T  # the codes are the values here (scale 1 / 127 a row, exact in float64)
    if not torch.allclose(got.double(), want, rtol=1e-6, atol=1e-3):
        raise ConfigError("quantization=w8a8: this CPU's INT8 products are not exact (its kernels saturate: an x86 "
                          "CPU without AVX-VNNI, AVX512-VNNI or AMX); use dtype=bf16 or fp32 without it")


def quantize_rows(x: torch.Tensor, shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (xq [M, K], sx [M, 1] FP32), (xq - shift) * sx ~ x: each row's largest |x| at 127, x / sx
    computed in FP32 and rounded to nearest (ties to even); int8 codes, or uint8 with `shift` 128 added. A row of
    zeros gets scale 1."""
    # few passes over x: the step runs ~50 of these on a handful of rows, where each op's fixed cost is the time
    amax = x.abs().amax(dim=1, keepdim=True).float()  # exact in x's dtype: a maximum rounds nothing
    sx = torch.where(amax > 0, amax / QMAX, 1.0)
    # x / sx promotes to FP32; |x / sx| <= 127 * (1 + 2^-23), so the rounded codes fit without a clamp
    codes = torch.round(x / sx)
    return (codes.add_(shift).to(torch.uint8) if shift else codes.to(torch.int8)), sx


def linear(x: torch.Tensor, weight: W8A8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) in W8A8: `weight` as quantize_weights gives it; x [..., K] of any float dtype; the
    result in x's dtype: the exact integer sum times the weight row's scale, then the input row's (FP32), plus
    the bias, rounded once."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if weight.packed is not None:
        xu, sx = quantize_rows(flat, _ZP)
        y = _onednn()[0](xu, 1.0, _ZP, weight.packed, weight.sw, weight.zeros, None, 1.0, 0, torch.float32,
                         "none", [], "")
        y.mul_(sx)
    else:
        xq, sx = quantize_rows(flat)
        y = torch.mul(torch._int_mm(xq, weight.wq_t), weight.sw).mul_(sx)  # int32 x FP32 -> FP32 in one pass
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype).reshape(*lead, weight.out_features)
