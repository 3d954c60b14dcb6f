"""C = A @ W^T (+ bias) (+ GeLU) in one Triton kernel: the epilogue rides on the GEMM.

cuBLAS is faster than this on plain products; what this buys is the FFN's
bias+GeLU without a second pass over the [T, ffn] activation (the largest
tensor of the layer), and at tiny M a tiling that keeps more SMs streaming
weights. The engine times both paths per shape bucket and keeps the faster
(torch_gpu.TorchEngine, gemm="auto", batch_invariant=False).

`linear_invariant` runs the same kernel with one tiling for every M: a row's sums then run
in the same order whatever else shares the batch (the engine's default, batch_invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACT_NONE, ACT_GELU, ACT_GELU_TANH = 0, 1, 2


def _configs():
    c = triton.Config
    return [
        c({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 1}, num_warps=4, num_stages=3),
        c({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 256, "GROUP_M": 1}, num_warps=4, num_stages=3),
        c({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    ]


def _prune(configs, named_args, **kwargs):
    m_class = named_args["M_CLASS"]
    keep = [c for c in configs if (c.kwargs["BLOCK_M"] <= 32) == (m_class == 0)]
    return keep or configs


@triton.autotune(configs=_configs(), key=["M_CLASS", "N", "K"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _gemm(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm, M_CLASS,
          HAS_BIAS: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(offs_n[None, :] < N) & kmask[:, None], other=0.0)
        if IEEE:  # FP32 operands in FP32 (Triton's default for FP32 dots is TF32)
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, act: int = ACT_NONE):
    """out[M, N] = act(a[M, K] @ w[N, K]^T + bias)."""
    m, k = a.shape
    n = w.shape[0]
    m_class = 0 if m <= 64 else 1 if m <= 1024 else 2
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemm[grid](a, w, bias if bias is not None else w, out, m, n, k, a.stride(0), w.stride(0), out.stride(0),
                m_class, HAS_BIAS=bias is not None, ACT=act, IEEE=a.dtype == torch.float32)
    return out


# The one tiling of linear_invariant. Batch invariance needs a row's K sums in one fixed order:
# no split-K, and the same tile shape and MMA instruction for every M (a per-M choice, as cuBLAS
# and the autotuned `linear` make, changes the order and so the last bits). 64 x 64 tiles: one
# Hopper warpgroup MMA; K in steps of 64.
INVARIANT = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}
INVARIANT_LAUNCH = {"num_warps": 4, "num_stages": 4}


def linear_invariant(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                     act: int = ACT_NONE) -> torch.Tensor:
    """out[M, N] = act(a[M, K] @ w[N, K]^T + bias), each row bit for bit the same for every M and
    every position of the row in `a` (one tiling, no split-K). FP32 operands multiply in FP32."""
    m, k = a.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, INVARIANT["BLOCK_M"]) * triton.cdiv(n, INVARIANT["BLOCK_N"]),)
    _gemm.fn[grid](a, w, bias if bias is not None else w, out, m, n, k, a.stride(0), w.stride(0), out.stride(0), 0,
                   HAS_BIAS=bias is not None, ACT=act, IEEE=a.dtype == torch.float32, **INVARIANT,
                   **INVARIANT_LAUNCH)
    return out
