"""The event-loop pause a model's reload causes in a serving process whose heap is frozen (runtime/gc_settle.py).

    PYTHONPATH=src python3 benchmarks/reload_pause.py [--reloads 7] [--model minilm|decoder] [--json OUT]

In process, as the server runs it: a repository of one model (the bundled MiniLM, or a tiny random qwen2 decoder
of tests/decoder_models.py), loaded, warmed up and frozen (gc_settle.settle, as the server's start-up does); then
reloaded --reloads times, with a probe task on the same loop that wakes every millisecond. Per reload: the
probe's longest wait (the event loop's longest pause, the model's build on its thread included), the longest
single garbage collection and all collections' time (gc.callbacks), and whether the retired build was freed
(weak reference). Prints medians; run it with another tree's src on PYTHONPATH to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT))  # tests.* helpers; surge itself from PYTHONPATH (the tree measured)


async def _measure(model: str, reloads: int) -> dict:
    import surge
    from surge.cli.bootstrap import load_repository_version
    from surge.config import ServerConfig
    from surge.runtime import gc_settle
    from surge.runtime.registry import ModelRegistry
    from surge.runtime.repository import ModelRepository
    from tests.e2e.repo_helpers import add_version

    tmp = Path(tempfile.mkdtemp(prefix="reload-pause-"))
    text = "engine: {threads: 1, warmup_shapes: [[1, 8]]}\n"
    if model == "decoder":
        from tests.decoder_models import build_model

        text += f"source: {build_model('qwen2', tmp / 'qwen2')}\n"
    add_version(tmp / "repo", "m", 1, text)
    config = ServerConfig(model_repository=tmp / "repo", grpc_port=None)
    built: list[weakref.ref] = []

    def loader(entry):
        service = load_repository_version(config, entry, single=False)
        built.append(weakref.ref(service))
        return service

    collections: list[float] = []
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append(time.perf_counter() - started[0])

    repo = ModelRepository(tmp / "repo", ModelRegistry(), loader)
    await repo.start()
    gc_settle.settle(True)
    stop = asyncio.Event()
    gaps: list[float] = []

    async def probe():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(probe())
    gc.callbacks.append(on_gc)
    rows = []
    try:
        for _ in range(reloads):
            await asyncio.sleep(0.2)
            gaps.clear()
            collections.clear()
            n = len(built)
            t0 = time.perf_counter()
            await repo.reload("m")
            took = time.perf_counter() - t0
            await asyncio.sleep(0.01)
            rows.append({"reload_s": took, "loop_max_pause_ms": max(gaps) * 1e3,
                         "gc_max_ms": max(collections, default=0.0) * 1e3, "gc_total_ms": sum(collections) * 1e3,
                         "retired_freed": built[n - 1]() is None, "frozen": gc.get_freeze_count()})
    finally:
        gc.callbacks.remove(on_gc)
        stop.set()
        await task
        await repo.close()
    med = {k: statistics.median(r[k] for r in rows) for k in ("reload_s", "loop_max_pause_ms", "gc_max_ms",
                                                               "gc_total_ms")}
    return {"tree": str(Path(surge.__file__).resolve().parents[2]), "model": model, "reloads": rows,
            "median": med, "all_freed": all(r["retired_freed"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reloads", type=int, default=7)
    ap.add_argument("--model", choices=["minilm", "decoder"], default="minilm")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out = asyncio.run(_measure(args.model, args.reloads))
    m = out["median"]
    print(f"{out['tree']} {out['model']}: medians of {args.reloads} reloads: loop max pause "
          f"{m['loop_max_pause_ms']:.1f} ms, longest collection {m['gc_max_ms']:.2f} ms, collections "
          f"{m['gc_total_ms']:.2f} ms, reload {m['reload_s']:.2f} s; retired builds all freed: {out['all_freed']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
