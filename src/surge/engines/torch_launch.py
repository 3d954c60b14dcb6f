"""The torch engine's CUDA run path: a batch staged into a free pinned slot, copied in, replayed from its
bucket's graph and copied out on the instance's stream (launch), then waited for and read back
(collect); `pipeline_depth` slots let the host stage batch k+1 while the GPU runs batch k.

A mixin of TorchEngine (engines/torch_gpu.py), apart from it because this is the per-batch host work on
CUDA alone (the CPU path is encoder_cpu's). Needs the engine's `device`, `dtype`, `plan`,
`workspace`, `stream`, `pool_mode`, `pipeline_depth`, `_shared_ws`, `_lock`, `_slices`, `_slots`,
`_h_inputs`, `_h_out`, `_done`, `_fixed`, `_tok_width`, `bucket`, `_ready_graph`, `_graph`,
`_forward`, `_inputs`, `on_device` and `_oom`.
"""

from __future__ import annotations

import numpy as np
import torch

from surge.errors import EngineError
from surge.types import TokenBatch


class PinnedLaunch:
    def _stage_inputs(self, ids, types, pos, lengths, key, host: torch.Tensor | None = None) -> int:
        bb, tb, _ = key
        t, b = len(ids), len(lengths)
        h = self._numpy(self._h_inputs if host is None else host)
        h[:3 * tb + bb + 1] = 0
        h[:t] = ids
        h[tb:tb + t] = types
        h[2 * tb:2 * tb + t] = pos
        cu = h[3 * tb:3 * tb + bb + 1]
        cu[1:b + 1] = np.cumsum(lengths)
        cu[b + 1:] = t  # empty sequences: their attention programs exit at once
        return 3 * tb + bb + 1

    def _ensure_slots(self) -> None:
        """The staging slots: (pinned inputs, pinned outputs, pinned heads output, done event) each.

        Slot 0 is the buffers load() made (subclasses that plan their own workspace make them
        too); the others are allocated here, on first use."""
        if self._slots is not None:
            return
        import queue

        with self._lock:
            if self._slots is not None:
                return
            heads = getattr(self, "_h_heads", None)
            pooled = getattr(self, "_h_pooled", None) if self.pool_mode is not None else None

            def like(t):
                return None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

            slots = [(self._h_inputs, self._h_out, heads, self._done, pooled)]
            for _ in range(self.pipeline_depth - 1):
                slots.append((like(self._h_inputs), like(self._h_out), like(heads), torch.cuda.Event(), like(pooled)))
            free: queue.SimpleQueue = queue.SimpleQueue()
            for i in range(len(slots)):
                free.put(i)
            self._free_slots = free
            self._slots = slots

    def _run_cuda(self, ids, types, pos, lengths, heads: bool = False):
        return self._collect_cuda(self._launch_cuda(ids, types, pos, lengths, heads))

    def _launch_cuda(self, ids, types, pos, lengths, heads: bool = False) -> "Launched":
        """One batch, up to the GPU: pack into a free pinned slot (no lock: overlaps the other
        slot's batch on the GPU), then under the lock enqueue copy in -> graph replay -> copy out
        -> event on this instance's stream. `_collect_cuda` waits for the event without the lock
        (the next batch enqueues behind this one meanwhile). The stream orders the two batches'
        use of the workspace."""
        self._ensure_slots()
        t = len(ids)
        key = self.bucket(len(lengths), t, int(lengths.max()))
        ws_lock = self.workspace.lock
        slot = self._free_slots.get()
        h_in, h_out_all, h_heads, done, h_pooled = self._slots[slot]
        pooled = self.pool_mode is not None and not heads
        # A workspace shared with other instances (their own streams) is held until the batch is done.
        shared_ws = self._shared_ws is not None
        try:
            n = self._stage_inputs(ids, types, pos, lengths, key, h_in)
            with self._lock:
                ws_lock.acquire()
                try:
                    self._heads_mode = heads
                    inputs = self._inputs_view(n)
                    ready = self._ready_graph(key)
                    if ready is not None:
                        # A captured bucket (every one after warm-up): the whole batch in one stream
                        # context; each context resolves the device in Python (tens of us on the H200
                        # host, a lone request's launch: docs/benchmarks/serving_core.md, session 5).
                        graph, views, out, mode = ready
                        with torch.cuda.stream(self.stream):
                            inputs.copy_(self._head(h_in, n), non_blocking=True)
                            graph.replay()
                            h_out = self._copy_out(out, key, t, len(lengths), heads, pooled, h_out_all, h_heads, h_pooled)
                            done.record(self.stream)
                    else:
                        with torch.cuda.stream(self.stream):
                            # inputs first: a new bucket's first (eager) forward and its capture read them
                            inputs.copy_(h_in[:n], non_blocking=True)
                        graph, views, out, mode = self._graph(key)
                        with torch.cuda.stream(self.stream):
                            if graph is not None:
                                graph.replay()
                            else:
                                out = self._forward(key, views, mode)
                            h_out = self._copy_out(out, key, t, len(lengths), heads, pooled, h_out_all, h_heads, h_pooled)
                            done.record(self.stream)
                    if shared_ws:
                        done.synchronize()
                finally:
                    ws_lock.release()
        except BaseException:
            self._free_slots.put(slot)
            raise
        return Launched(self, slot, done, h_out, key, t, len(lengths), heads, pooled)

    def _copy_out(self, out, key, t: int, b: int, heads: bool, pooled: bool, h_out_all, h_heads, h_pooled):
        """Enqueue the batch's result into its pinned slot (on the current stream); the slot's view."""
        head = self._head
        if heads:  # the graph's output is the heads' logits: [bb, fixed] then [tb, widths]
            n = key[0] * self._fixed + t * self._tok_width
            h_out = head(h_heads, n)
            h_out.copy_(head(out, n), non_blocking=True)
        elif pooled:  # the graph's output is the pooled rows: [bb, hidden] float32
            h_out = head(h_pooled, b)
            h_out.copy_(head(out, b), non_blocking=True)
        else:
            h_out = head(h_out_all, t)
            h_out.copy_(out[:t].view(h_out.dtype), non_blocking=True)
        return h_out

    def _head(self, tensor: torch.Tensor, n: int) -> torch.Tensor:
        """`tensor[:n]`, made once per tensor and size: a slice is several torch calls, and a lone
        request's launch makes three (pinned inputs, graph output, pinned output). The view keeps
        its base alive, so a key's id() cannot be reused by another tensor while it is here; the
        sizes are bounded by the buckets."""
        memo = self._slices
        k = (id(tensor), n)
        v = memo.get(k)
        if v is None:
            if len(memo) > 4096:  # a bound, should buckets ever be many more than planned
                memo.clear()
            v = memo[k] = tensor[:n]
        return v

    def _numpy(self, tensor: torch.Tensor):
        """A pinned host tensor's numpy view, made once (as `_head`)."""
        memo = self._slices
        k = (id(tensor), "np")
        v = memo.get(k)
        if v is None:
            v = memo[k] = (tensor, tensor.numpy())
        return v[1]

    def _inputs_view(self, n: int) -> torch.Tensor:
        """The workspace's first `n` input slots, made once per size (a view costs several torch calls)."""
        gen = self.workspace.generation
        if getattr(self, "_in_views_gen", None) != gen:
            self._in_views, self._in_views_gen = {}, gen
        v = self._in_views.get(n)
        if v is None:
            v = self._in_views[n] = self.workspace.view(self.plan.region("inputs"), (n,))
        return v

    def _collect_cuda(self, job: "Launched"):
        try:
            job.done.synchronize()
            res = job.h_out.numpy().copy()
        finally:
            self._free_slots.put(job.slot)
        if job.heads:
            bb, t, b = job.key[0], job.tokens, job.rows
            fixed = res[:bb * self._fixed].reshape(bb, self._fixed)[:b]
            tokens = res[bb * self._fixed:].reshape(t, self._tok_width) if self._tok_width else None
            return fixed, tokens
        if self.dtype == torch.bfloat16 and not job.pooled:
            res = (res.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return res

    def launch(self, batch: TokenBatch) -> "Launched":
        """The host part of run() (checks, packing, copy, graph launch), returning at once; the
        caller waits (`Launched.wait`, off its event loop) then takes the rows (`collect`). With
        pooling in the graph only: run() is collect(launch()). The batcher calls launch and collect
        on its event loop and only the wait on a thread: no GIL hand-offs for the host work."""
        if self.pool_mode is None or self.device.type != "cuda":
            raise EngineError("launch/collect needs pooling in the graph on CUDA (attach_pooling)")
        ids, types, pos, lengths = self._inputs(batch)
        try:
            with self.on_device():
                return self._launch_cuda(ids, types, pos, lengths)
        except torch.cuda.OutOfMemoryError as exc:
            raise self._oom(lengths) from exc

    def collect(self, job: "Launched") -> np.ndarray:
        return self._collect_cuda(job)


class Launched:
    """A batch on its way through the GPU (TorchEngine.launch): wait() blocks without the GIL."""

    __slots__ = ("engine", "slot", "done", "h_out", "key", "tokens", "rows", "heads", "pooled")

    def __init__(self, engine, slot, done, h_out, key, tokens, rows, heads, pooled):
        self.engine, self.slot, self.done, self.h_out, self.key = engine, slot, done, h_out, key
        self.tokens, self.rows, self.heads, self.pooled = tokens, rows, heads, pooled

    def wait(self) -> None:
        self.done.synchronize()

    def ready(self) -> bool:
        return self.done.query()
