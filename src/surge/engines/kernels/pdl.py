"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode step of a 0.5B model is ~200 kernels of 2-8 us, and each one's start (launch, the first
DRAM round trip for its weights) waits for the previous one's last CTA. With PDL (Hopper and newer)
a kernel is launched while its predecessor still runs; it loads what does not depend on the
predecessor (its weights, the step's metadata), then waits (`griddepcontrol.wait`) for the
predecessor's grid to finish and flush before it reads activations or writes anything.

The contract every kernel here keeps when its PDL flag is set: no global store and no load of
anything a kernel of the same step writes before `wait()`, called unconditionally by every program
(a program that returned early without waiting would let the kernel complete before its
predecessor). `launch_dependents()` comes right after the wait, so a kernel's successor can
only start once this kernel's predecessor has completed (what the successor loads before its own
wait was therefore written two kernels back at the latest, and nothing in a step writes weights or
metadata).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Wait for the predecessor grid, then let the successor launch (no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def supported(device_index: int = 0) -> bool:
    """PDL needs a Hopper-class GPU (compute capability >= 9) and a Triton that launches with it."""
    import torch

    if not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        import triton.language.extra.cuda as cuda_ext
    except ImportError:
        return False
    return hasattr(cuda_ext, "gdc_wait") and hasattr(cuda_ext, "gdc_launch_dependents")


def launch_kw(pdl: bool) -> dict:
    """The launch option that asks Triton for a PDL launch (nothing when off, for Tritons without it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at `ptrs` in L2 (no registers filled; for weights read after the wait)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
