"""CUDA graph capture that other threads' GPU work cannot break.

torch.cuda.graph's default mode ("global") fails a capture when any other thread makes a CUDA call that is
unsafe during capture while it is open (a synchronize, an event query, an allocation, a cuBLAS handle's creation:
another engine serving on the same GPU, an instance on another stream, a replica on another GPU, NCCL's watchdog
thread of a tensor-parallel shard do all of them; replicas on two H200s failed with CUBLAS_STATUS_NOT_INITIALIZED). A decoder loaded, or reloaded without downtime, beside a model that serves then
failed its warm-up with cudaErrorStreamCaptureInvalidated; in the GPU tests, an engine thread an earlier test
left behind failed a later test's capture now and then. "thread_local" checks the capturing thread only (the
encoder's captures had used it since the replicas' failure; now every engine's does). Captures run one at a time in the process: two open at
once would share the caching allocator's capture bookkeeping.

Thread-local mode does not cover a device-wide synchronization: a cudaDeviceSynchronize (torch.cuda.synchronize(),
and empty_cache's frees) from any thread invalidates a capture open on another (measured on an H100 in session 47:
tests/gpu/test_decoder_cuda.py::test_decoder_graphs_are_captured_while_another_engine_serves failed with it, passed
with a stream's synchronize). Engines wait on their own streams and events; what must be device-wide goes through
`device_wide`, which waits for any capture open to end.

Nor does it cover what the garbage collector frees while a capture is open: an earlier engine left in a reference
cycle (a test's, a retired model's) whose CUDA graphs and memory pool a collection releases frees device memory,
an implicit device-wide synchronization, from whichever thread the collection runs in (measured on an H100 in
session 48: the whole GPU directory failed a later FP8 engine's capture with "operation failed due to a previous
error during capture"; the test alone passed). So no automatic collection runs while a capture is open; what it
would have freed waits for the next one.
"""

from __future__ import annotations

import contextlib
import gc
import threading

LOCK = threading.RLock()  # re-entrant: device_wide may be called from inside a capture's failure path


@contextlib.contextmanager
def capture(graph, **kwargs):
    """`torch.cuda.graph(graph, **kwargs)` in thread-local error mode, under the process's capture lock."""
    import torch

    with LOCK, _no_collection(), torch.cuda.graph(graph, capture_error_mode="thread_local", **kwargs):
        yield


@contextlib.contextmanager
def _no_collection():
    """The process's automatic garbage collection off for the block (as it was before, after it)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def device_wide(fn, *args):
    """`fn(*args)` (torch.cuda.empty_cache, torch.cuda.synchronize: device-wide calls) while no capture is open."""
    with LOCK:
        return fn(*args)
