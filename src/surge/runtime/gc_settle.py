"""Keep the garbage collector's full passes off the request path.

A serving process holds hundreds of thousands of long-lived objects after start-up (torch, the model's
modules, the web stack, tokenizers: 237,000 tracked in a decoder's front end, 105,000 in the bundled
MiniLM's). CPython's full (generation 2) collection walks all of them, holding the GIL (140-210 ms and
~50 ms on the 2-core VM), and every request of that process waits: a p99 spike. `settle()` is called once a
process is ready (models loaded and warmed up): one collection, then `gc.freeze()` moves every object alive
into the permanent generation, which later collections skip; what requests allocate is still collected as
before. The serve command's `--gc-freeze` (default on; `--no-gc-freeze` or SURGE_GC_FREEZE=0 turns it off)
reaches every process of the server through that variable (`configure`): engine processes are spawned, not
forked, and each settles itself once its own engine is warm.

Frozen objects are still freed by reference counting, but never by the collector: a retired model whose
objects held a reference cycle would stay for good. So a built service holds none (the contract of every
service's close(): its task runner holds it weakly, its cache's sketch calls back through a weak method, its
metrics and views let go at close, its batcher's cancelled scheduler leaves no frames behind), and a model
retired at run time (unload, reload, a version replaced: runtime/repository.py) is freed by reference
counting the moment its last reference goes, frozen or not, with no collection. A model loaded or retired
settles the process again (`resettle`): what is not frozen (the new build, what requests left) is collected
and frozen, a pass over those objects only (a few ms), not the whole heap. `resettle(thaw=True)` is the
safety net, for a retired build still alive after its retirement (a cycle that only the collector frees,
logged by the repository): the heap is unfrozen, collected whole (one full pass, ~50-300 ms of GIL that
every request of the process waits for) and frozen again. Measured: docs/benchmarks.md ("Garbage
collection in a serving process").
"""

from __future__ import annotations

import gc
import os

ENV = "SURGE_GC_FREEZE"  # ServerConfig.gc_freeze's variable; spawned processes read it (settle)

_frozen = False  # whether settle() froze this process (gc's state is the process's)


def configure(enabled: bool) -> None:
    """The server's `--gc-freeze` for this process and every process it spawns from now on (front ends,
    engine processes: they inherit the environment)."""
    os.environ[ENV] = "1" if enabled else "0"


def enabled() -> bool:
    """Whether processes of this server freeze their heap once ready (SURGE_GC_FREEZE, default on)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def settle(on: bool | None = None) -> bool:
    """Collect once and freeze what is alive; False (nothing done) where freezing is off (`on`: the server's
    gc_freeze; None: from SURGE_GC_FREEZE, as an engine process spawned by the server reads it)."""
    global _frozen
    if not (enabled() if on is None else on):
        return False
    gc.collect()
    gc.freeze()
    _frozen = True
    return True


def resettle(thaw: bool = False) -> bool:
    """Settle again after a model was loaded or retired: what is not frozen is collected and frozen (the
    frozen heap is not walked); `thaw` True (the safety net for a retired build that reference counting did
    not free): unfreeze first and collect the whole heap, so that frozen objects held only by a reference
    cycle are freed. False (nothing done) where this process never settled (freezing off, or still starting:
    settle() comes after the start-up's loads)."""
    if not _frozen:
        return False
    if thaw:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    return True
