"""The calling thread's current CUDA device and stream, set through torch's C-level calls.

`torch.cuda.device(d)` and `torch.cuda.stream(s)` resolve the device index in Python every time
they are entered (`torch.cuda._get_device_index`, with `is_available` and environment lookups):
a lone batch's launch entered three such contexts and made five of those calls, about half of its
112-198 us of host work on the H200 host (cProfile of 2,000 launches, docs/benchmarks/serving_core.md,
session 4). These contexts take the index once, when the engine is built, and do only the
exchange: the same C functions the torch contexts end up in. Each `with` makes a fresh object, so
they nest and run from several threads like torch's own.
"""

from __future__ import annotations

import torch


class on_device:
    """`with on_device(index):` the device current for the block, the previous one restored after."""

    __slots__ = ("idx", "prev")

    def __init__(self, idx: int):
        self.idx = idx
        self.prev = -1

    def __enter__(self):
        self.prev = torch._C._cuda_exchangeDevice(self.idx)
        return self

    def __exit__(self, *exc) -> None:
        torch._C._cuda_maybeExchangeDevice(self.prev)


class on_stream:
    """`with on_stream(ids):` the stream current on its device for the block (device stays as it is;
    enter `on_device` first where the thread may be on another GPU). `ids` is `stream_ids(stream)`."""

    __slots__ = ("ids", "prev")

    def __init__(self, ids: tuple[int, int, int]):
        self.ids = ids
        self.prev = None

    def __enter__(self):
        sid, idx, kind = self.ids
        self.prev = torch._C._cuda_getCurrentStream(idx)
        torch._C._cuda_setStream(stream_id=sid, device_index=idx, device_type=kind)
        return self

    def __exit__(self, *exc) -> None:
        sid, idx, kind = self.prev
        torch._C._cuda_setStream(stream_id=sid, device_index=idx, device_type=kind)


def stream_ids(stream: torch.cuda.Stream) -> tuple[int, int, int]:
    """(stream_id, device_index, device_type): what `on_stream` sets."""
    return stream.stream_id, stream.device_index, stream.device_type
