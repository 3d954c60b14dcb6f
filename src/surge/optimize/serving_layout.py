"""The engine layout an artifact serves fastest with on this CPU: a measured decision, kept in its manifest.

How a CPU's cores are spent matters as much as the graph. One ONNX Runtime session with every core as an
intra-op thread parallelizes each operator; as many single-thread sessions, run concurrently (the server's
`--instances`), each take whole batches. A graph of big GEMMs gains most of a second thread inside its
operators (FP32 MiniLM ~1.8x on 2 cores); a graph of many small operators does not: the INT8 graph's ~400
quantization-chain nodes (Shape, Reshape, per-row QuantizeLinear) gain ~1.2x, each one too small to split,
while two sessions keep both cores busy. On session 48's 2-core AMX VM the INT8 artifact served at 1.05x the
FP32 one with one two-thread session (the default) and at 1.74-1.79x with `--threads 1 --instances 2..4`
(docs/benchmarks/optimizer.md, sessions 7 and 48). So `surge optimize` times the artifact at its serving batch
size (optimize/serving_batch.py) both ways on the usable cores, and the manifest's `serving.threads` and
`serving.instances` become the engine layout when the artifact is served and nothing else sets one (--threads,
--instances, their SURGE_* variables, a model.yaml's engine section: cli/bootstrap.load_service).

The layout is measured for a core count (`serving.layout.cores`): a server with another number of usable cores
does not apply it (the right layout there is another measurement).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

TOLERANCE = 0.05  # a layout must be this much (relative) faster than one session to be kept over it
QUERIES = 256  # at the least; more at big batch sizes so that each instance runs several batches
BATCHES_PER_INSTANCE = 4  # the fewest batches each concurrent session gets (the last batch's tail is small)
MAX_INSTANCES = 64  # EngineConfig.instances' bound


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's share, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def layouts(cores: int) -> list[tuple[int, int]]:
    """The (threads, instances) layouts timed on `cores` cores: one session with every core, and one
    single-thread session a core (the same when there is one core)."""
    cores = max(1, cores)
    return [(cores, 1)] if cores == 1 else [(cores, 1), (1, min(cores, MAX_INSTANCES))]


def choose(ms_per_query: dict[tuple[int, int], float], tolerance: float = TOLERANCE) -> tuple[int, int]:
    """The (threads, instances) layout to serve with: of those whose time per query is within `tolerance`
    (relative) of the fastest, the one with the fewest instances.

    On a tie fewer instances win: one session answers each batch with all its threads (lower latency a request
    when the server is not saturated), and holds one copy of the weights and arenas instead of several; a timing
    this close is within the machine's noise anyway."""
    if not ms_per_query:
        raise ValueError("no layout was measured")
    best = min(ms_per_query.values())
    tied = [layout for layout, ms in ms_per_query.items() if ms <= best * (1.0 + tolerance)]
    return min(tied, key=lambda layout: (layout[1], -layout[0]))


def layout_hint(artifact: Path | str | None) -> dict | None:
    """{"threads", "instances", "cores"} an artifact's manifest records for its serving layout, or None (none
    measured: an artifact from before, `--no-latency`, not an artifact)."""
    import json

    if artifact is None:
        return None
    try:
        serving = json.loads((Path(artifact) / "manifest.json").read_text()).get("serving", {})
        threads, instances = serving.get("threads"), serving.get("instances")
        cores = serving.get("layout", {}).get("cores")
    except (OSError, ValueError, AttributeError):
        return None
    # Manifests before the layout measurement have serving.threads (the batch-size timing's one thread) and no
    # instances: no layout.
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (threads, instances, cores)):
        return None
    if instances > MAX_INSTANCES:
        return None
    return {"threads": threads, "instances": instances, "cores": cores}


def _batches(spec, texts: list[str], names: set[str], batch_size: int, queries: int, seed: int) -> list[dict]:
    """Feeds of `queries` held-out texts, length-sorted and padded `batch_size` at a time as the batcher groups
    them, the longest batch first (dealt to concurrent sessions in that order: the last batches, which leave
    sessions idle while another finishes, are the shortest)."""
    from surge.optimize.validate import encode_texts
    from surge.types import TokenBatch

    rng = np.random.default_rng(seed)
    pick = [texts[i] for i in rng.choice(len(texts), queries, replace=len(texts) < queries)]
    items = sorted(encode_texts(spec, pick), key=len)
    feeds = []
    for i in range(0, len(items), batch_size):
        b = TokenBatch.pad(items[i:i + batch_size], pad_id=spec.pad_token_id)
        feeds.append({k: v for k, v in (("input_ids", b.input_ids), ("attention_mask", b.attention_mask),
                                         ("token_type_ids", b.token_type_ids)) if k in names})
    return feeds[::-1]


def _run_concurrently(sessions: list, feeds: list[dict]) -> float:
    """Seconds for `sessions` to run every feed, each session in its own thread taking the next feed when it is
    free, as the batcher hands batches to free engine instances (ONNX Runtime releases the GIL in run)."""
    if len(sessions) == 1:
        t = time.perf_counter()
        for f in feeds:
            sessions[0].run(None, f)
        return time.perf_counter() - t
    lock, position, errors = threading.Lock(), [0], []

    def work(sess) -> None:
        try:
            while True:
                with lock:
                    i = position[0]
                    position[0] += 1
                if i >= len(feeds):
                    return
                sess.run(None, feeds[i])
        except Exception as exc:  # noqa: BLE001 -- re-raised in the caller: a failed run is no timing
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,), name=f"surge-layout-{k}") for k, s in enumerate(sessions)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    if errors:
        raise errors[0]
    return elapsed


def measure(model: bytes, spec, texts: list[str], batch_size: int, disabled_optimizers=(), cores: int | None = None,
            rounds: int = 3, queries: int | None = None, seed: int = 0, progress=None) -> dict:
    """Median ms a query of `model` served at `batch_size` in each layout of `layouts(cores)` (interleaved rounds
    over the same batches), and the layout `choose` keeps: the manifest's `serving` fields `threads` and
    `instances`, with the timings under `layout`. `cores`: the usable cores (default: this process's).

    Sessions as the server builds them (engines/onnxrt.py: parked threads between operators, the artifact's
    disabled optimizers, the engines' INT8 weights)."""
    from surge.optimize.validate import session

    cores = cores or usable_cores()
    candidates = layouts(cores)
    if queries is None:
        queries = max(QUERIES, batch_size * BATCHES_PER_INSTANCE * max(i for _, i in candidates))
    sessions: dict[tuple[int, int], list] = {}
    for threads, instances in candidates:
        if progress:
            progress(f"{instances} session{'s' if instances > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}")
        sessions[(threads, instances)] = [session(model, threads, list(disabled_optimizers), spinning=False)
                                          for _ in range(instances)]
    first = next(iter(sessions.values()))[0]
    feeds = _batches(spec, texts, {i.name for i in first.get_inputs()}, batch_size, queries, seed)
    for group in sessions.values():  # every session's first run of each shape: allocations out of the timing
        for sess in group:
            for f in feeds:
                sess.run(None, f)
    n = sum(len(f["input_ids"]) for f in feeds)
    per_round: dict[tuple[int, int], list[float]] = {layout: [] for layout in candidates}
    for r in range(rounds):  # interleaved, the order reversed every other round: a slow phase hits both layouts
        for layout in (candidates if r % 2 == 0 else candidates[::-1]):
            per_round[layout].append(_run_concurrently(sessions[layout], feeds) * 1e3 / n)
    ms = {layout: round(float(np.median(v)), 4) for layout, v in per_round.items()}
    threads, instances = choose(ms)
    return {"threads": threads, "instances": instances,
            "layout": {"cores": cores, "batch_size": batch_size, "queries": n, "rounds": rounds, "tolerance": TOLERANCE,
                       "ms_per_query": [{"threads": t, "instances": i, "ms": v} for (t, i), v in ms.items()],
                       "rule": "one session with every core unless single-thread sessions, one a core, run a query "
                               "more than the tolerance faster"}}
