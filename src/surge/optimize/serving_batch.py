"""The batch size an artifact serves fastest at on this CPU: a measured decision, kept in its manifest.

A CPU engine's time per query is not flat in the batch size. On session 11's 2-core Sapphire Rapids VM
(2.0 GHz, 2 MiB of L2 a core) both MiniLM artifacts ran a query fastest at 8-16 queries a batch and up to
~2x slower per query at 64 (INT8 1.35-1.71 ms a query at 8 against 3.45-3.65 at 64; FP32 2.86-3.20
against 5.5): a 64-query batch's [tokens, 1536] FP32 activations no longer fit the core's caches, and
the INT8 graph, whose per-row quantization chains and FP32 outlier products are memory-bound passes,
loses most (docs/benchmarks/optimizer.md, issue 21, session 11). The batcher's default cap (64) suits
GPU engines. So `surge optimize` times the optimized model at several batch sizes of held-out queries
(length-sorted and padded as the batcher groups them; one intra-op thread without spinning, as
`--threads 1 --instances N` serves), and the manifest's `serving.max_batch_size` becomes the batcher's cap
when the artifact is served and nothing else sets one (--max-batch-size, SURGE_MAX_BATCH_SIZE, a
model.yaml's batching section: cli/bootstrap.load_service).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

SIZES = (4, 8, 16, 32, 64)
TOLERANCE = 0.05  # sizes this close to the fastest count as tied; the largest of them is kept
QUERIES = 256  # a multiple of every size: each size runs the same queries


def choose(ms_per_query: dict[int, float], tolerance: float = TOLERANCE) -> int:
    """The largest batch size whose time per query is within `tolerance` (relative) of the fastest.

    On a tie the larger batch wins: it takes a burst in fewer engine runs (fewer wake-ups, less
    queueing under load), and a timing this close is within the machine's noise anyway."""
    if not ms_per_query:
        raise ValueError("no batch size was measured")
    best = min(ms_per_query.values())
    return max(size for size, ms in ms_per_query.items() if ms <= best * (1.0 + tolerance))


def serving_hint(artifact: Path | str | None) -> int | None:
    """The `serving.max_batch_size` an artifact's manifest records, or None (none measured, not an artifact)."""
    import json

    if artifact is None:
        return None
    manifest = Path(artifact) / "manifest.json"
    try:
        size = json.loads(manifest.read_text()).get("serving", {}).get("max_batch_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(size) if isinstance(size, int) and size >= 1 else None


def measure(model: bytes, spec, texts: list[str], disabled_optimizers=(), threads: int = 1,
            sizes: tuple[int, ...] = SIZES, rounds: int = 3, queries: int = QUERIES, seed: int = 0) -> dict:
    """Median ms a query of `model` at each batch size (interleaved rounds over the same `queries` texts),
    and the size `choose` keeps: the manifest's `serving` section."""
    from surge.optimize.validate import encode_texts, session
    from surge.types import TokenBatch

    rng = np.random.default_rng(seed)
    pick = [texts[i] for i in rng.choice(len(texts), queries, replace=len(texts) < queries)]
    items = sorted(encode_texts(spec, pick), key=len)
    sess = session(model, threads, list(disabled_optimizers), spinning=False)
    names = {i.name for i in sess.get_inputs()}
    plans = {}
    for size in sizes:
        feeds = []
        for i in range(0, len(items), size):
            b = TokenBatch.pad(items[i:i + size], pad_id=spec.pad_token_id)
            feeds.append({k: v for k, v in (("input_ids", b.input_ids), ("attention_mask", b.attention_mask),
                                             ("token_type_ids", b.token_type_ids)) if k in names})
        sess.run(None, feeds[0])  # first run of a shape: allocations out of the timing
        plans[size] = feeds
    per_round: dict[int, list[float]] = {size: [] for size in sizes}
    for r in range(rounds):  # interleaved, the order reversed every other round: a slow phase hits all sizes
        for size in (sizes if r % 2 == 0 else tuple(reversed(sizes))):
            t = time.perf_counter()
            for f in plans[size]:
                sess.run(None, f)
            per_round[size].append((time.perf_counter() - t) * 1e3 / len(items))
    ms = {size: round(float(np.median(v)), 4) for size, v in per_round.items()}
    # batch_threads, not threads: the manifest's serving.threads is the engine layout (optimize/serving_layout.py)
    return {"max_batch_size": choose(ms), "ms_per_query": {str(k): v for k, v in ms.items()}, "batch_threads": threads,
            "queries": len(items), "rounds": rounds, "tolerance": TOLERANCE,
            "rule": "the largest batch size within the tolerance of the fastest time per query"}
