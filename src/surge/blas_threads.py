"""numpy's BLAS on one thread for a block of code.

OpenBLAS starts one thread per core and its threads spin while they wait for work. Code that makes many small
BLAS calls loses to that, and on a small machine it also takes the cores other work needs. Measured on the 2-core
VM:

- the host task heads' [B, 384] x [384, 384] products took 9.6 ms of CPU at batch 8 against 0.16 ms on one
  thread (engines/heads.py);
- GPTQ's row-by-row feedback ran 1.39-1.48x faster on one thread beside a busy core and 1.00-1.21x alone
  (optimize/gptq.py; benchmarks/gptq_blas_threads.py, docs/benchmarks/optimizer.md, session 50).

The limit is set and restored around each block (~15 us). Without threadpoolctl, numpy keeps its own threading."""

from __future__ import annotations

import contextlib

_CONTROLLER = None


def one_blas_thread(fresh: bool = False):
    """A context in which numpy's BLAS runs on one thread. The BLAS libraries are found once, at the first call;
    `fresh` looks again (~0.5 ms), so that one loaded since then (scipy's, which scipy.linalg loads on first
    import) is limited too: for offline code."""
    global _CONTROLLER
    if fresh and _CONTROLLER:
        _CONTROLLER = None
    if _CONTROLLER is None:
        try:
            from threadpoolctl import ThreadpoolController

            _CONTROLLER = ThreadpoolController()
        except ImportError:  # not installed: numpy's own threading
            _CONTROLLER = False
    if not _CONTROLLER:
        return contextlib.nullcontext()
    return _CONTROLLER.limit(limits=1, user_api="blas")
