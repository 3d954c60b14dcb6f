"""Triton kernels of the GPU encoder (import only where CUDA and Triton exist).

`available()` says whether they can run here; the encoder falls back to plain
PyTorch ops otherwise (CPU CI).
"""

from __future__ import annotations


def available() -> bool:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
