"""CUDA graph capture that other threads' GPU work cannot break.

torch.cuda.graph's default mode ("global") fails a capture when any other thread makes a CUDA call that is
unsafe during capture while it is open (a synchronize, an event query, an allocation: another engine serving on
the same GPU does all of them). A decoder loaded, or reloaded without downtime, beside a model that serves then
failed its warm-up with cudaErrorStreamCaptureInvalidated; in the GPU tests, an engine thread an earlier test
left behind failed a later test's capture now and then. "thread_local" checks the capturing thread only, as the
encoder's captures already did (engines/torch_gpu.py). Captures run one at a time in the process: two open at
once would share the caching allocator's capture bookkeeping.
"""

from __future__ import annotations

import contextlib
import threading

LOCK = threading.Lock()


@contextlib.contextmanager
def capture(graph, **kwargs):
    """`torch.cuda.graph(graph, **kwargs)` in thread-local error mode, under the process's capture lock."""
    import torch

    with LOCK, torch.cuda.graph(graph, capture_error_mode="thread_local", **kwargs):
        yield
