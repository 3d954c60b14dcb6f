"""INT8 products on the CPU (`--generation quantization=w8a8`): compressed-tensors' W8A8 scheme, run with integers.

A CPU decode step is ~80% linear layers and the LM head, and their weights are read from memory once a step
(session 36's profile). With `w8a8` every linear weight and the LM head are INT8, symmetric, one FP32 scale a row
(models/weight_quant.quantize: half BF16's bytes, a quarter of FP32's), and each product quantizes its input one
row at a time (symmetric INT8, the row's largest |x| at 127: "dynamic per token") and multiplies with integers
(torch._int_mm: oneDNN's VNNI / AMX kernels where the CPU has them), so

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n] + bias[n]

with the integer sum exact: a row's output depends on that row alone, never on the batch it is in.
Measured on a 2-core AMD EPYC with AVX-512 VNNI (benchmarks/generate.py --quantization w8a8, docs/benchmarks.md).

The answers are a W8A8 model's, not the full-precision model's: each weight and each activation row rounded to
8 bits. Small models and GPT-2-size ones keep their greedy tokens for most prompts (the tests measure it against
transformers on the same rounding); models with outlier activation channels (LLM.int8's > 6B) lose more.
"""

from __future__ import annotations

import torch

from surge.models.weight_quant import quantize

QMAX = 127.0


def quantize_weights(weights: dict, names) -> dict:
    """name -> (wq^T [K, N] int8 view, sw [N] FP32) for each of `names`, quantized from its [N, K] weight in the
    dict's dtype; the full-precision tensors are dropped from `weights` (a tied LM head keeps the embedding,
    another name for the same storage)."""
    out = {}
    for name in names:
        w = weights.pop(name)
        q, s = quantize(w, "int8")
        out[name] = (q.t(), s.float())  # torch._int_mm reads the transposed view faster than a copy (measured)
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (xq [M, K] int8, sx [M, 1] FP32), xq * sx ~ x: each row's largest |x| at 127, x / sx
    computed in FP32 and rounded to nearest (ties to even). A row of zeros gets scale 1."""
    # few passes over x: the step runs ~50 of these on a handful of rows, where each op's fixed cost is the time
    amax = x.abs().amax(dim=1, keepdim=True).float()  # exact in x's dtype: a maximum rounds nothing
    sx = torch.where(amax > 0, amax / QMAX, 1.0)
    # x / sx promotes to FP32; |x / sx| <= 127 * (1 + 2^-23), so the rounded codes fit without a clamp
    return torch.round(x / sx).to(torch.int8), sx


def linear(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear(x, w, bias) in W8A8: `weight` as quantize_weights gives it; x [..., K] of any float dtype; the
    result in x's dtype (the FP32 product rounded once, the bias added before the rounding)."""
    wq_t, sw = weight
    lead = x.shape[:-1]
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = torch.mul(torch._int_mm(xq, wq_t), sx).mul_(sw)  # int32 x FP32 -> FP32 in one pass
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype).reshape(*lead, wq_t.shape[1])
