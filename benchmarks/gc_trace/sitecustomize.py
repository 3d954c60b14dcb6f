"""Times every garbage collection of a real server process (benchmarks only; on PYTHONPATH, imported at start-up).

Active when SURGE_GC_TRACE names a directory: each process (front end, engine process) appends JSON lines to
`<dir>/<pid>.jsonl`, one a collection: {"t": start (time.monotonic, system-wide), "ms", "gen", "collected",
"thread"}, flushed by a daemon thread every 0.2 s (the callback itself only appends to a list). SIGUSR2 writes a
census line {"census": ...}: tracked objects frozen and not, gc's thresholds and counts, the tracked objects by the
top-level package of their type (or a function's module), and what one full collection costs with the heap
as it is (what it collects, and the tracked objects outside the permanent generation before and after) and with
everything unfrozen (the census then unfreezes, collects, and freezes again where it was frozen).
SURGE_GC_TRACE_THRESHOLD=A,B,C sets gc.set_threshold(A, B, C) at start-up, to measure other thresholds.
"""

import os

if os.environ.get("SURGE_GC_TRACE"):
    import collections
    import gc
    import json
    import signal
    import threading
    import time

    _dir = os.environ["SURGE_GC_TRACE"]
    os.makedirs(_dir, exist_ok=True)
    _lines: list = []
    _start: list = [0.0]

    def _callback(phase, info):
        if phase == "start":
            _start[0] = time.monotonic()
        else:
            t = _start[0]
            _lines.append({"t": t, "ms": 1e3 * (time.monotonic() - t), "gen": info["generation"],
                           "collected": info["collected"], "thread": threading.current_thread().name})

    gc.callbacks.append(_callback)
    if os.environ.get("SURGE_GC_TRACE_THRESHOLD"):
        gc.set_threshold(*(int(v) for v in os.environ["SURGE_GC_TRACE_THRESHOLD"].split(",")))

    def _write(records):
        with open(os.path.join(_dir, f"{os.getpid()}.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def _flush():
        while True:
            time.sleep(0.2)
            if _lines:
                batch = _lines[:]
                del _lines[:len(batch)]
                _write(batch)

    def _package(o) -> str:
        try:
            mod = getattr(o, "__module__", None) if callable(o) and not isinstance(o, type) else None
        except Exception:  # noqa: BLE001 - a proxy whose attribute lookup fails: counted by its type
            mod = None
        mod = mod if isinstance(mod, str) else type(o).__module__
        return mod.split(".")[0] if isinstance(mod, str) else "?"

    def _census(*_):
        frozen, before = gc.get_freeze_count(), len(gc.get_objects())
        t = time.perf_counter()
        collected = gc.collect()
        now_ms = 1e3 * (time.perf_counter() - t)
        after = len(gc.get_objects())
        gc.unfreeze()
        try:
            objs = gc.get_objects()
            by_pkg = collections.Counter(_package(o) for o in objs)
            by_type = collections.Counter(type(o).__name__ for o in objs)
            n = len(objs)
            del objs
            t = time.perf_counter()
            gc.collect()
            unfrozen_ms = 1e3 * (time.perf_counter() - t)
        finally:
            if frozen:
                gc.freeze()
        _write([{"census": {"frozen": frozen, "unfrozen_before_collect": before, "collected": collected,
                            "unfrozen_after_collect": after, "tracked": n, "threshold": gc.get_threshold(), "count": gc.get_count(),
                            "full_ms_unfrozen": unfrozen_ms, "full_ms_as_it_was": now_ms,
                            "by_package": by_pkg.most_common(15), "by_type": by_type.most_common(10)}}])

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, _census)
    threading.Thread(target=_flush, daemon=True, name="gc-trace").start()
