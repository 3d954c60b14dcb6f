"""8-bit weights for a decoder's linear layers, one scale per output row: FP8 (E4M3) or INT8.

A decode step of a few dozen sequences reads every weight once and does little arithmetic with it, so
its GEMMs run at memory bandwidth: one byte a weight instead of BF16's two halves what they read. Only
the weights are quantized ("W8A16"): the kernels convert a tile to the activations' dtype in registers
(E4M3 values and the integers -127..127 are all exact in BF16 and FP16), multiply in that dtype with FP32
sums, and scale each output column once at the end, so the activations keep their precision. One scale
per output row of W (a column of the product) follows the rows' ranges more closely than vLLM's one scale
a tensor and costs nothing extra: it multiplies a whole K sum. The embedding, the norms and the LM head
stay in the model's dtype (as vLLM's online FP8 leaves them).

FP8 (vLLM's `--quantization fp8`) keeps more of each weight's relative precision (3 mantissa bits at any
magnitude) and needs a GPU that converts E4M3 in hardware (compute capability 8.9+: Ada, Hopper); INT8 (the
form of compressed-tensors' W8A16 checkpoints) spends its 8 bits on a uniform grid, finer for a row's large
values, coarser for its small ones, and runs on any GPU with BF16 arithmetic (8.0+: Ampere's A100 on).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448: E4M3's largest finite value (no infinities in the "fn" variant)
INT8_MAX = 127.0  # symmetric: -128 is never used, so q and -q are both codes
KINDS = {"fp8": FP8, "int8": torch.int8}
WEIGHT_DTYPES = tuple(KINDS.values())

SCALE_SUFFIX = ".scale"  # weights dict: "l3.qkv" holds the 8-bit tensor, "l3.qkv.scale" its [N] FP32 scales


def quantize(w: torch.Tensor, kind: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn or int8, scale [N] float32), q * scale[:, None] ~ w.

    Each row's largest |w| maps to the format's largest value (448, or 127); every element is rounded to the
    nearest code (ties to even: the E4M3 conversion's rounding, torch.round's), computed in FP32 on w's device.
    A row of zeros gets scale 1 (its q is zeros)."""
    if w.dim() != 2:
        raise ValueError(f"quantize takes a [N, K] weight, not {list(w.shape)}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, not {kind!r}")
    top = FP8_MAX if kind == "fp8" else INT8_MAX
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    # the division can land a hair above the top for the row's largest element: clamp, not overflow
    scaled = (wf / scale[:, None]).clamp_(-top, top)
    q = scaled.to(FP8) if kind == "fp8" else scaled.round_().to(torch.int8)
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation rows x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32), q * scale ~ x: each row's
    largest |x| (at least 1e-12) maps to 448, x * (448 / amax) rounded to the nearest code (ties to even), scale
    amax / 448; both divisions IEEE, in FP32 (the form of engines/kernels/fp8_rows.py's kernels)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    top = torch.full_like(amax, FP8_MAX)  # tensor / tensor divides; torch's tensor-scalar forms multiply by reciprocals
    return (xf * (top / amax)).clamp_(-FP8_MAX, FP8_MAX).to(FP8), amax / top


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale[:, None], computed in FP32 and rounded once to `dtype`."""
    return (q.float() * scale[:, None]).to(dtype)


def quantize_linears(weights: dict, names, kind: str = "fp8") -> dict:
    """The weights dict with each of `names` replaced by its 8-bit form and its scales added under
    name + SCALE_SUFFIX (in place; returned). A weight is quantized and its full-precision tensor
    dropped one at a time, so the peak memory is the model plus one layer's largest weight."""
    for name in names:
        q, s = quantize(weights[name], kind)
        weights[name] = q
        weights[name + SCALE_SUFFIX] = s
    return weights


def supported(device: torch.device, kind: str = "fp8") -> bool:
    """Whether the device's kernels run this kind of weights: FP8 tiles convert in hardware from compute capability
    8.9 (Ada, Hopper) on; INT8 tiles convert everywhere, the BF16 products need 8.0 (Ampere) on."""
    need = (8, 9) if kind == "fp8" else (8, 0)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= need


def kind_of(dtype: torch.dtype) -> str | None:
    """'fp8' / 'int8' for an 8-bit weight dtype, else None."""
    return next((k for k, d in KINDS.items() if d == dtype), None)
