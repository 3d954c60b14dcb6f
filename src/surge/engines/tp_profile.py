"""Where a tensor-parallel forward spends its time, measured on every rank at once.

All ranks run the same three measurements in lockstep (the collectives keep
them together), each `iters` times, and rank 0 reports its medians:

* total:     the real forward (all-reduces included) — what `run` costs on the device;
* compute:   the same forward with the all-reduces left out (wrong numbers, right work);
* allreduce: the forward's 2 x layers all-reduces of [tokens, hidden] alone.

On CUDA each variant is one CUDA graph replayed and timed with events (the
engine's own graph for the total); on the CPU wall-clock time of the reference
path. total - compute - allreduce is what neither explains (waiting for the
slower rank, launch gaps); it can be negative when one hides behind the other.
"""

from __future__ import annotations

import statistics
import time

import torch

from surge.engines.graph_capture import capture
from surge.types import TokenBatch


def _median_ms(fn, iters: int, sync=None) -> float:
    times = []
    for _ in range(iters):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cuda_ms(fn, iters: int, stream, sync=None) -> float:
    times = []
    for _ in range(iters):
        if sync is not None:
            sync()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            s.record()
            fn()
            e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def profile(runner, groups, batch: TokenBatch, iters: int) -> dict:
    """Run on every rank with the same batch (rank 0's engine broadcasts it first)."""
    runner.run(batch)  # builds (and on CUDA captures) this batch's bucket on every rank
    layers = len(runner.weights.layers)
    world = 1 if groups is None else groups.world
    t = batch.real_tokens
    if runner.device.type == "cuda":
        out = _profile_cuda(runner, groups, batch, iters, layers)
    else:
        out = _profile_cpu(runner, groups, batch, iters, layers)
    out.update(world=world, tokens=t, layers=layers, allreduces=2 * layers if world > 1 else 0,
               allreduce_bytes=t * runner.config.hidden * runner.dtype.itemsize)
    out["other_ms"] = out["total_ms"] - out["compute_ms"] - out["allreduce_ms"]
    return out


def _barrier(groups):
    if groups is None:
        return None
    return lambda: groups.broadcast(torch.zeros(1, dtype=torch.int64))


def _profile_cpu(runner, groups, batch, iters, layers) -> dict:
    from surge.engines.encoder import position_ids

    ids, types, lengths = batch.input_ids, batch.token_type_ids, batch.lengths
    pos = position_ids(lengths, runner.config.position_offset)
    sync = _barrier(groups)
    total = _median_ms(lambda: runner._run_reference(ids, types, pos, lengths), iters, sync)
    reduce, runner.reduce = runner.reduce, None
    try:
        compute = _median_ms(lambda: runner._run_reference(ids, types, pos, lengths), iters, sync)
    finally:
        runner.reduce = reduce
    ar = 0.0
    if groups is not None:
        buf = torch.randn(len(ids), runner.config.hidden, dtype=runner.dtype)

        def reduces():
            for _ in range(2 * layers):
                reduce(buf)  # the forward's own (an all-reduce, or the rank-order sum)
        ar = _median_ms(reduces, iters, sync)
    return {"total_ms": total, "compute_ms": compute, "allreduce_ms": ar, "timer": "wall clock (CPU)"}


def _profile_cuda(runner, groups, batch, iters, layers) -> dict:
    lengths = batch.lengths
    key = runner.bucket(len(lengths), int(lengths.sum()), int(lengths.max()))
    sync = _barrier(groups)
    with runner._lock, runner.workspace.lock:
        graph, views, _, _ = runner._graph(key)
        stream = runner.stream
        replay = graph.replay if graph is not None else (lambda: runner._forward(key, views))
        total = _cuda_ms(replay, iters, stream, sync)

        reduce, runner.reduce = runner.reduce, None  # the same work without the all-reduces
        try:
            compute_fn = _capture(lambda: runner._forward(key, views), stream, runner.cuda_graphs)
        finally:
            runner.reduce = reduce
        compute = _cuda_ms(compute_fn, iters, stream, sync)

        ar = 0.0
        if groups is not None:
            tmp = views["tmp"]

            def reduces():
                for _ in range(2 * layers):
                    reduce(tmp)  # the forward's own (an all-reduce, or the rank-order sum)
            ar = _cuda_ms(_capture(reduces, stream, runner.cuda_graphs), iters, stream, sync)
        # the profile variants wrote garbage into the workspace; the engine's graphs rewrite it each run
        stream.synchronize()
    return {"total_ms": total, "compute_ms": compute, "allreduce_ms": ar, "timer": "CUDA events"}


def _capture(fn, stream, use_graph: bool):
    with torch.cuda.stream(stream):
        fn()  # eager once: kernels compiled, NCCL ready
    if not use_graph:
        return fn
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with capture(g, stream=stream):
        fn()
    return g.replay


def summary_row(name: str, p: dict) -> list[str]:
    return [name, f"{p['total_ms']:.2f}", f"{p['compute_ms']:.2f}", f"{p['allreduce_ms']:.2f}",
            f"{p['other_ms']:.2f}", str(p["allreduces"])]

