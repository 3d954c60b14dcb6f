"""Tensor descriptors for the decode step's TMA loads (Hopper's tensor memory accelerator).

A kernel that reads its operands through descriptors has whole tiles copied into shared memory by the
copy engine, with the rows and columns outside the tensor filled with zeros: no address arithmetic or
masks in the kernel, and more bytes in flight an SM than pointer loads keep (measured on the layer GEMMs
at M = 64: docs/benchmarks/generate.md, session 18). Descriptors are made on the host at each launch;
a CUDA graph keeps the ones its capture made, which stay valid because a graph's tensors keep their
addresses.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def usable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can read these 2-D tensors: CUDA on Hopper or newer, a Triton with host descriptors,
    the last dimension contiguous, the base and the row stride 16-byte aligned (the copy engine's rules)."""
    for t in tensors:
        if not t.is_cuda or t.dim() != 2 or t.stride(1) != 1:
            return False
        size = t.element_size()
        if t.data_ptr() % 16 or (t.stride(0) * size) % 16:
            return False
    return _supported(tensors[0].device.index or 0)


def descriptor(t: torch.Tensor, block: tuple[int, int]):
    """A host tensor descriptor of the 2-D tensor `t` read in `block`-shaped tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))
