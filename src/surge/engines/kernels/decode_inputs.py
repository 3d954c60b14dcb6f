"""The next decode step's inputs made on the device from the step just run (multi-step launches).

A launch of several decode steps replays the step's CUDA graph back to back with no host in
between (runtime/scheduler/overlap.py), so each step must leave the next one's inputs where the
graph reads them: the staging buffer `packed` [5, n] (engines/decoder/graphs.py: ids, positions,
cache slots, context lengths, source rows). Every row moves one position on; its cache slot is
looked up in its block table (the scheduler reserved the blocks of the whole launch); its input
token is its own output (source row = itself). Padded rows' tables are all scratch blocks, so they
keep writing the scratch block.

One small kernel instead of the dozen torch ops the same arithmetic takes (a few microseconds each
inside the graph, every step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _next_inputs(packed_ptr, tables_ptr, n, width, stride_p, stride_t, BS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    ok = rows < n
    pos = tl.load(packed_ptr + stride_p + rows, mask=ok, other=0) + 1
    col = tl.minimum(pos // BS, width - 1)
    block = tl.load(tables_ptr + rows.to(tl.int64) * stride_t + col, mask=ok, other=0).to(tl.int64)
    tl.store(packed_ptr + stride_p + rows, pos, mask=ok)
    tl.store(packed_ptr + 2 * stride_p + rows, block * BS + pos % BS, mask=ok)
    tl.store(packed_ptr + 3 * stride_p + rows, pos + 1, mask=ok)
    tl.store(packed_ptr + 4 * stride_p + rows, rows.to(tl.int64), mask=ok)


def next_decode_inputs(packed: torch.Tensor, tables: torch.Tensor, n: int, block_size: int) -> None:
    """engines/decoder/graphs.next_decode_inputs_torch in one kernel (the same values), on CUDA tensors."""
    if packed.dtype != torch.long or tables.dtype != torch.int32 or packed.stride(1) != 1 or tables.stride(1) != 1:
        raise ValueError("packed must be int64 and tables int32, both with contiguous rows")
    _next_inputs[(1,)](packed, tables, n, tables.shape[1], packed.stride(0), tables.stride(0), BS=block_size,
                       BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)
