"""FP8 activations for FP8 weights (W8A8, vLLM's FP8 form on Hopper): rows quantized as they come, FP8 tensor cores.

The engine's FP8 weights were weight-only (each weight tile converted to BF16 in the kernel): at every model size
measured that ran slower than BF16 (benchmarks/gpu_fp8_forms.py, session 38, H200: the four layer GEMMs at 64 rows
0.78x BF16 at Qwen2-0.5B's shape, 0.82x at Llama-1B's, 0.71x at Llama-3-8B's), the conversion costing more than the
halved bytes save. With the activation rows in E4M3 too, both operands feed the FP8 tensor cores and cuBLASLt's
FP8 GEMM (`torch._scaled_mm`, one FP32 scale a row of each operand applied to the FP32 sums) reads the weight at
one byte an element with nothing converted: at Llama-3-8B's shape 1.20x BF16 at 64 rows, 1.31x at 128; at
Llama-1B's the gate/up product 1.19x. In the engine (H100, 64 streams): 1.21x BF16's tokens/s at the 8B shape, 1.11x
at 1B, 0.84x at 0.5B (docs/benchmarks/generate.md, session 38).

Each row of x is scaled so its largest |x| maps to E4M3's 448 and rounded to the nearest code (ties to even); the
row's scale is amax / 448. A row's codes depend on that row alone; the product's last bits can still depend on the
row count, by which cuBLASLt picks its kernel (the GPU tests bound a row alone against itself in a batch).
models/weight_quant.quantize_rows is the same arithmetic in torch (the kernels here equal it bit for bit).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from surge.models.weight_quant import FP8, FP8_MAX

FP8_MAX_T = tl.constexpr(FP8_MAX)


@triton.jit
def fp8_row_codes(y, mask, q_ptr, s_ptr):
    """Store row y's (FP32, masked lanes 0) E4M3 codes at q_ptr and its scale at s_ptr (quantize_rows' arithmetic:
    IEEE divisions, so the codes are torch's)."""
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12)
    inv = tl.math.div_rn(FP8_MAX_T, amax)
    tl.store(q_ptr, tl.clamp(y * inv, -FP8_MAX_T, FP8_MAX_T).to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr, tl.math.div_rn(amax, FP8_MAX_T))


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < K
    y = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    fp8_row_codes(y, ok, q_ptr + row * K + offs, s_ptr + row)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows of K contiguous elements) -> (q [M, K] float8_e4m3fn, scale [M, 1] float32), q * scale ~ x:
    models/weight_quant.quantize_rows in one launch (a program a row)."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_rows reads rows of contiguous elements")
    q = torch.empty((m, k), device=x.device, dtype=FP8)
    s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(k)
    _quantize_rows[(m,)](x, q, s, k, x.stride(0), BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return q, s


def scaled_linear(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(xq * xs) @ (wq * ws[:, None])^T (+ bias) in out_dtype: xq [M, K] and wq [N, K] E4M3, xs [M, 1] and ws [N]
    FP32 scales. The FP32 sums are scaled and rounded once (cuBLASLt's FP8 GEMM); a bias is added to that rounded
    product (a second rounding)."""
    if xq.data_ptr() % 16 or xs.data_ptr() % 16:  # cuBLASLt takes 16-byte-aligned operands (a sliced batch's rows)
        xq, xs = xq.clone(), xs.clone()
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=out_dtype)
    return out.add_(bias) if bias is not None else out


def fits(n: int, k: int) -> bool:
    """Whether cuBLASLt's FP8 GEMM takes a [N, K] weight: both dimensions multiples of 16."""
    return n % 16 == 0 and k % 16 == 0


@functools.lru_cache(maxsize=None)
def supported(device_index: int = 0) -> bool:
    """Whether this GPU and torch multiply FP8 rows with row-wise scales (`torch._scaled_mm`; Hopper-class GPUs,
    compute capability 9.0+): a small product is tried once and checked against float64."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index) < (9, 0):
        return False
    dev = torch.device("cuda", device_index)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8, 64, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 64, device=dev, generator=g)
    try:
        from surge.models.weight_quant import quantize

        wq, ws = quantize(w, "fp8")
        xq, xs = quantize_rows(x)
        got = scaled_linear(xq, xs, wq, ws).double()
    except (RuntimeError, NotImplementedError):  # an older torch / cuBLASLt without row-wise FP8 scales
        return False
    want = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).T
    return bool(((got - want).norm() / want.norm()).item() < 1e-2)
