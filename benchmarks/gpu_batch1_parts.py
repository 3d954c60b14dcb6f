"""Where a lone request's engine time goes on the GPU: the served engine (as `surge serve` builds it,
pooling in the CUDA graph), one sentence at a time, its phases timed on the host.

    PYTHONPATH=src python3 benchmarks/gpu_batch1_parts.py --model-dir MODEL_DIR [--iters 2000]

Phases (medians, microseconds): make_batch (packing the token ids), launch (checks, staging, the
copies and the graph replay enqueued), wait (host blocked on the batch's CUDA event), collect (rows
copied out), and "gpu": CUDA events on the instance's stream before and after the launch (the
batch's GPU work, or the host's enqueueing where that is slower). The
batcher's "inference" stage is launch + wait + collect plus its loop's scheduling.

`--gap-us N` leaves N microseconds between requests, as a server at one client does (the client
and the front end run meanwhile): slept (`--gap sleep`, the thread idles and its core may halt or
run other work) or busy (`--gap spin`, the thread keeps its core). Back to back (0) every phase
runs with hot caches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="also cProfile 2000 launches (top functions by own time)")
    p.add_argument("--gap-us", type=float, default=0.0, help="time between requests (default 0: back to back)")
    p.add_argument("--gap", default="sleep", choices=("sleep", "spin"), help="how the gap is spent")
    args = p.parse_args()
    import torch

    from surge.cli.bootstrap import load_service
    from surge.config import EngineConfig, ServerConfig
    from surge.data import load_sentences
    from surge.models import load_model_spec

    config = ServerConfig(engine=EngineConfig(engine="torch", device="cuda", precision="fp16"))
    spec = load_model_spec(Path(args.model_dir))
    service = load_service(config, spec)
    w = service.worker
    pool = w.engines
    texts = load_sentences()
    items = [w.tokenizer.encode([t])[0] for t in texts]
    phases = {k: [] for k in ("make_batch", "launch", "wait", "collect", "total", "gpu")}
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    engine = pool.engines[0]
    gap = args.gap_us / 1e6
    for i in range(args.iters):
        it = [items[i % len(items)]]
        if gap and args.gap == "sleep":
            time.sleep(gap)
        elif gap:
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                pass
        t0 = time.perf_counter()
        batch = w.make_batch(it)
        t1 = time.perf_counter()
        ev0.record(engine.stream)
        token = pool.launch(batch)
        ev1.record(engine.stream)
        t2 = time.perf_counter()
        token[1].wait()
        t3 = time.perf_counter()
        pool.collect(token)
        t4 = time.perf_counter()
        ev1.synchronize()
        if i >= 100:
            for k, v in (("make_batch", t1 - t0), ("launch", t2 - t1), ("wait", t3 - t2), ("collect", t4 - t3),
                         ("total", t4 - t0), ("gpu", ev0.elapsed_time(ev1) / 1e3)):
                phases[k].append(v * 1e6)
    med = {k: round(statistics.median(v), 1) for k, v in phases.items()}
    print("| phase | median us |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {v} |")
    if args.out:
        Path(args.out).write_text(json.dumps(med))
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        for i in range(2000):
            batch = w.make_batch([items[i % len(items)]])
            prof.enable()
            token = pool.launch(batch)
            prof.disable()
            token[1].wait()
            pool.collect(token)
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
