"""How many rows a CPU GEMM call may hold while no row's bits depend on the others (batch invariance).

oneDNN and MKL choose kernels, blockings and the order in which they sum K by a call's row count M, and
place a row in M-blocks whose tail kernels may sum in another order; so a row of a packed batch can round
differently depending on which other rows share its call. Measured on torch 2.13, Sapphire Rapids, 1-2
threads: a row's bits never depend on the other rows' values, nor on its place in a call of a fixed M;
across M, packed fp32 oneDNN GEMMs agree for every M >= 2, packed bf16 ones with K=1536 only up to M of
about 144, and F.linear in fp32 has three families (M=1, 2-15, 16+).

A batch-invariant CPU forward therefore pads its rows to a multiple of ROW_CHUNK (never a lone row) and
runs each GEMM in calls of at most `bound` rows: the largest of GEMM_BOUNDS (0: any count, one call) under
which `probe_bound` finds a row's bits unchanged, PROBE_ROWS random rows in calls of the bound against
calls on slices of them. The probe samples row counts and offsets; it does not prove them. Where it was
shown wrong (F.linear's fallback in bf16 at one thread accepted 64 rows), callers run calls of exactly
ROW_CHUNK rows instead, which keeps a row's bits by construction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch

ROW_CHUNK = 8
GEMM_BOUNDS = (0, 256, 128, 64, 32, 16, 8)
PROBE_ROWS = 2048  # about a full batch of 64 short sentences; larger row counts are not probed
# (rows, offset) of the probe's calls: row counts across oneDNN's kernel switches (16, 32, 64 rows and
# its M-blocking tails), at offsets that put a row in another block than in the full call.
PROBE_SLICES = ((8, 0), (8, 520), (8, 1208), (16, 0), (16, 512), (16, 8), (24, 8), (32, 0), (32, 40), (40, 0),
                (48, 0), (48, 72), (56, 8), (64, 0), (64, 128), (80, 0), (96, 8), (104, 0), (112, 16), (120, 8),
                (144, 0), (200, 8), (208, 32), (248, 8), (320, 0), (448, 96), (512, 256), (784, 0), (1000, 8),
                (1008, 16), (1536, 0), (2040, 8))

_BOUNDS: dict = {}
_LOCK = threading.Lock()

Call = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def in_chunks(call: Call, x: torch.Tensor, r: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """call(x, r) in calls of at most `chunk` rows, in order (0: one call)."""
    if chunk == 0 or x.size(0) <= chunk:
        return call(x, r)
    return torch.cat([call(x[s:s + chunk], None if r is None else r[s:s + chunk]) for s in range(0, x.size(0), chunk)])


def probe_bound(call: Call, k: int, n: int, dtype: torch.dtype, residual: bool, key: Hashable) -> int:
    """The largest of GEMM_BOUNDS under which `call` (x [M, k] and, with `residual`, r [M, n] -> [M, n])
    gives each row the same bits whatever the call's row count (a multiple of ROW_CHUNK) and the row's
    place in it; ROW_CHUNK where none is. `key` names the kernel (shapes, dtype, thread count, epilogue):
    the answer is cached per process under it."""
    with _LOCK:
        if key in _BOUNDS:
            return _BOUNDS[key]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, k, generator=g).to(dtype)
    r = torch.randn(PROBE_ROWS, n, generator=g).to(dtype) if residual else None
    bound = ROW_CHUNK
    with torch.inference_mode():
        for c in GEMM_BOUNDS:
            ref = in_chunks(call, x, r, c)
            if all(torch.equal(call(x[s:s + m], None if r is None else r[s:s + m]), ref[s:s + m])
                   for m, s in PROBE_SLICES if c == 0 or (m <= c and s % c + m <= c)):
                bound = c
                break
    with _LOCK:
        _BOUNDS[key] = bound
    return bound
