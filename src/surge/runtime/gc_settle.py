"""Keep the garbage collector's full passes off the request path.

A serving process holds millions of long-lived objects after start-up (torch, the model's modules,
the web stack, tokenizers). CPython's full (generation 2) collection walks all of them, so one pass
stalls that process's event loop for tens of milliseconds, and every request it holds waits: a
p99 spike. `settle()` is called once a process is ready: one collection, then `gc.freeze()` moves
every object alive into the permanent generation, which later collections skip; what requests
allocate is still collected as before. SURGE_GC_FREEZE=0 turns it off (measured against it in
docs/benchmarks/serving_core.md, session 4).
"""

from __future__ import annotations

import gc
import os


def settle() -> bool:
    """Collect once and freeze what is alive; False (nothing done) when SURGE_GC_FREEZE=0."""
    if os.environ.get("SURGE_GC_FREEZE", "1") == "0":
        return False
    gc.collect()
    gc.freeze()
    return True
