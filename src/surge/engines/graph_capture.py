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
"""

from __future__ import annotations

import contextlib
import threading

LOCK = threading.RLock()  # re-entrant: device_wide may be called from inside a capture's failure path


@contextlib.contextmanager
def capture(graph, **kwargs):
    """`torch.cuda.graph(graph, **kwargs)` in thread-local error mode, under the process's capture lock."""
    import torch

    with LOCK, torch.cuda.graph(graph, capture_error_mode="thread_local", **kwargs):
        yield


def device_wide(fn, *args):
    """`fn(*args)` (torch.cuda.empty_cache, torch.cuda.synchronize: device-wide calls) while no capture is open."""
    with LOCK:
        return fn(*args)
