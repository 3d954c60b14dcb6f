"""FP8 (E4M3) weights for a decoder's linear layers, one scale per output channel (vLLM's `--quantization fp8`).

A decode step of a few dozen sequences reads every weight once and does little arithmetic with it, so
its GEMMs run at memory bandwidth: one byte a weight instead of BF16's two halves what they read. Only
the weights are quantized ("W8A16"): the kernels convert a tile to the activations' dtype in registers
(E4M3 values are exact in BF16 and FP16), multiply in that dtype with FP32 sums, and scale each output
column once at the end, so the activations keep their precision. One scale per output row of W (a
column of the product) follows the weight's rows' ranges more closely than vLLM's one scale a tensor
and costs nothing extra: it multiplies a whole K sum. The embedding, the norms and the LM head stay in
the model's dtype (as vLLM's online FP8 leaves them).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448: E4M3's largest finite value (no infinities in the "fn" variant)

SCALE_SUFFIX = ".scale"  # weights dict: "l3.qkv" holds the FP8 tensor, "l3.qkv.scale" its [N] FP32 scales


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale [N] float32), q * scale[:, None] ~ w.

    Each row's largest |w| maps to 448; every element is rounded to the nearest E4M3 value (ties to
    even, as the dtype conversion rounds), computed in FP32 on w's device. A row of zeros gets scale 1
    (its q is zeros)."""
    if w.dim() != 2:
        raise ValueError(f"quantize takes a [N, K] weight, not {list(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # the division can land a hair above 448 for the row's largest element: clamp, not overflow to NaN
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale[:, None], computed in FP32 and rounded once to `dtype`."""
    return (q.float() * scale[:, None]).to(dtype)


def is_quantized(weights: dict, name: str) -> bool:
    return name + SCALE_SUFFIX in weights


def quantize_linears(weights: dict, names) -> dict:
    """The weights dict with each of `names` replaced by its FP8 form and its scales added under
    name + SCALE_SUFFIX (in place; returned). A weight is quantized and its full-precision tensor
    dropped one at a time, so the peak memory is the model plus one layer's largest weight."""
    for name in names:
        q, s = quantize(weights[name])
        weights[name] = q
        weights[name + SCALE_SUFFIX] = s
    return weights


def supported(device: torch.device) -> bool:
    """FP8 tiles convert in hardware from compute capability 8.9 (Ada, Hopper) on."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
