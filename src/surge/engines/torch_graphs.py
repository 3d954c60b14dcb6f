"""The torch engine's CUDA graphs: one captured per shape bucket (on synthetic inputs at warm-up, so that
nothing is captured while serving), and with gemm="auto" the GEMM mode that replays fastest on it.

A mixin of TorchEngine (engines/torch_gpu.py), apart from it because capturing and timing graphs is
the engine's build step, not its run path. Needs the engine's `device`, `config`, `plan`, `workspace`,
`stream`, `cuda_graphs`, `gemm`, `max_graphs`, `head_set`, `choices`, `mode_errors`, `builds`,
`build_s`, `_graphs`, `_slices`, `_lock`, `_ws_generation`, `_heads_mode`, `_h_inputs`, `modes`,
`_views`, `_forward` and `_stage_inputs`.
"""

from __future__ import annotations

import numpy as np
import torch

from surge.engines.encoder import position_ids
from surge.engines.graph_capture import capture, device_wide

# (weights key, token bucket) -> the GEMM mode gemm="auto" timed fastest. The mode changes the GEMMs
# only, whose shapes depend on the token bucket alone: buckets that differ in sequences or length
# reuse the choice, and so does a second instance of the model on the GPU (warm-up ~halved).
_MODE_CHOICE: dict[tuple, str] = {}


class BucketGraphs:
    def _build(self, key) -> None:
        """Capture one bucket on valid synthetic inputs: full sequences of lb tokens, as many as fit."""
        bb, tb, lb = key
        lens = [lb] * (tb // lb) + ([tb % lb] if tb % lb else [])
        lengths = np.asarray(lens[:bb], dtype=np.int64)
        t = int(lengths.sum())
        rng = np.random.default_rng(tb * 1000 + lb)
        ids = rng.integers(0, min(self.config.vocab, 30522), t).astype(np.int64)
        types = np.zeros(t, np.int64)
        pos = position_ids(lengths, self.config.position_offset)
        with self._lock, self.workspace.lock:
            n = self._stage_inputs(ids, types, pos, lengths, key)
            inputs = self.workspace.view(self.plan.region("inputs"), (n,))
            with torch.cuda.stream(self.stream):
                inputs.copy_(self._h_inputs[:n], non_blocking=True)
            # A model with heads in its graph only ever runs the heads graphs: build those.
            self._heads_mode = self.head_set is not None
            self._graph(key)
            self.stream.synchronize()

    def _capture(self, key, views, gemm: str):
        with torch.cuda.stream(self.stream):
            out = self._forward(key, views, gemm)  # compiles/tunes the Triton kernels, creates cuBLAS handles
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with capture(graph, stream=self.stream):
            out = self._forward(key, views, gemm)
        return graph, out

    def _time(self, graph, reps: int = 10) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            graph.replay()
            start.record(self.stream)
            for _ in range(reps):
                graph.replay()
            end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) / reps

    def _graph(self, key):
        """(graph or None, views, output view, gemm mode) for a bucket; captured on first use.

        gemm="auto": every mode is captured and timed on this bucket, the fastest kept.
        """
        if self.workspace.generation != self._ws_generation:  # a shared workspace grew: old views are stale
            self._graphs.clear()
            self._slices.clear()
            self._ws_generation = self.workspace.generation
        gkey = key + (self._heads_mode,)  # hidden-state and heads graphs are kept apart
        g = self._graphs.get(gkey)
        if g is not None:
            self._graphs.move_to_end(gkey)
            return g
        import time

        started = time.perf_counter()
        views = self._views(key)
        modes = self.modes(key)
        mode = modes[0] if self.gemm == "auto" or self.gemm not in modes else self.gemm
        if not self.cuda_graphs:
            with torch.cuda.stream(self.stream):
                out = self._forward(key, views, mode)
            g = (None, views, out, mode)
        elif self.gemm != "auto" or (getattr(self, "_wkey", None), key[1]) in _MODE_CHOICE:
            if self.gemm == "auto":
                mode = _MODE_CHOICE[(self._wkey, key[1])]
                mode = mode if mode in modes else "cublas"
            graph, out = self._capture(key, views, mode)
            g = (graph, views, out, mode)
        else:
            best = None
            timings = {}
            for m in modes:
                try:
                    graph, out = self._capture(key, views, m)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot build here is skipped, not fatal
                    if m == "cublas":
                        raise
                    self.mode_errors[m] = f"{type(exc).__name__}: {exc}"[:500]
                    device_wide(torch.cuda.synchronize, self.device)
                    continue
                timings[m] = self._time(graph)
                if best is None or timings[m] < timings[best[3]]:
                    best = (graph, views, out, m)
            self.choices[key] = timings
            g = best
            if getattr(self, "_wkey", None) is not None:
                _MODE_CHOICE[(self._wkey, key[1])] = best[3]
        self._graphs[gkey] = g
        self.builds += 1
        self.build_s += time.perf_counter() - started
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return g

    def _ready_graph(self, key):
        """The bucket's captured graph entry when nothing needs building first, else None (`_graph` then)."""
        if not self.cuda_graphs or self.workspace.generation != self._ws_generation:
            return None
        gkey = key + (self._heads_mode,)
        g = self._graphs.get(gkey)
        if g is None or g[0] is None:
            return None
        self._graphs.move_to_end(gkey)
        return g
