"""Weights pulled into L2 ahead of the decode-step kernels that read them, from a side stream.

A decode step of a 0.5B model at 64 streams reads ~1 GB of weights through ~170 kernels of 2-8 us;
each GEMM's time is mostly its first DRAM round trips, not its bytes (docs/benchmarks/generate.md,
session 10: the step is 2.8x its memory floor). PDL lets a kernel prefetch its own slice only from
its predecessor's tail. Here a side stream, forked from the step's stream one or two kernels
earlier, asks the copy engine of a few CTAs for whole weight matrices with Hopper's bulk L2 prefetch
(`cp.async.bulk.prefetch.L2.global`: one instruction a 16-KiB range, no registers, no shared
memory, fire and forget), so that the GEMM finds them in L2 (50 MB on an H100/H200; a layer's MLP is
26 MB for the Qwen2-0.5B shape). A prefetch is only a hint: it never changes a result, and the
kernels read the same addresses either way.

Contract: `bulk_prefetch(tensors)` launches one kernel on the current stream over the bytes of the
given contiguous CUDA tensors (at most MAX_TENSORS; the last bytes of a tensor past its last
16-byte boundary are not asked for). It writes nothing and reads nothing into registers.
`supported()` says whether the GPU has the instruction (compute capability >= 9).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes a thread asks for with one instruction (a multiple of 16)
BLOCK = 128  # threads' chunks a program
MAX_TENSORS = 4


@triton.jit
def _bulk(ptr, nbytes, start, pid, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # this program's chunks of one tensor: byte offsets, sizes rounded down to 16
    offs = ((pid - start) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK)
    size = tl.where(size > 0, size, 0).to(tl.int32) & -16
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
        "mov.u32 $0, 0;\n\t}",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.int8)) + offs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, s1, s2, s3, COUNT: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < s1:
        _bulk(p0, n0, 0, pid, CHUNK, BLOCK)
    elif COUNT > 1 and pid < s2:
        _bulk(p1, n1, s1, pid, CHUNK, BLOCK)
    elif COUNT > 2 and pid < s3:
        _bulk(p2, n2, s2, pid, CHUNK, BLOCK)
    elif COUNT > 3:
        _bulk(p3, n3, s3, pid, CHUNK, BLOCK)


@functools.lru_cache(maxsize=None)
def supported(device_index: int = 0) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device_index)[0] >= 9


def bulk_prefetch(tensors: list[torch.Tensor]) -> None:
    """Ask L2 for every byte of `tensors` (contiguous, on one CUDA device), one launch."""
    if not tensors:
        return
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensors a launch, got {len(tensors)}")
    args, starts, total = [], [], 0
    per_program = CHUNK * BLOCK
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("bulk_prefetch needs contiguous tensors")
        nbytes = t.numel() * t.element_size()
        starts.append(total)
        total += -(-nbytes // per_program)
        args += [t, nbytes]
    count = len(tensors)
    while len(args) < 2 * MAX_TENSORS:  # unused slots: never reached (their start is the grid's end)
        args += [tensors[0], 0]
        starts.append(total)
    _prefetch_kernel[(total,)](*args, starts[1], starts[2], starts[3], COUNT=count, CHUNK=CHUNK, BLOCK=BLOCK,
                                num_warps=BLOCK // 32)
