"""CUDA graphs of the decode step, one per batch-size bucket.

A decode step is the same kernels every time for a given batch size; replaying
a captured graph removes the launch overhead of several hundred small kernels
(the step's cost at small batches). Inputs are copied into static buffers;
padded rows write their K/V into the cache's scratch block and are not sampled.
The attention kernel reads the context lengths and block tables from the
buffers, so one graph serves any context length up to max_model_len.

With `steps` > 1 (multi-step launches, runtime/scheduler/overlap.py) each graph
ends by writing the next step's inputs into its own buffers
(`next_decode_inputs`), so `run(..., steps=k)` stages once and replays k times
with no host work in between but a read-back copy of each step's tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from surge.engines.decoder.attention import AttnMeta
from surge.engines.graph_capture import capture

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TIMED_CONTEXT = 256  # positions of context at which multi-step graphs time their step (a chat turn's)
# Host staging sets, used in turn: a set is refilled RING steps after its last use, so up to RING - 1
# launched steps may be in flight (runtime/scheduler/overlap.py's depth) before the loop reads one back.
RING = 4


def next_decode_inputs_torch(packed: torch.Tensor, tables: torch.Tensor, n: int, block_size: int) -> None:
    """The next decode step's inputs from this one's, in place on packed[:, :n] (int64 [5, >= n]: ids,
    positions, slots, context lengths, source rows; tables int32 [>= n, width]): positions + 1, the
    slot of the new position in the row's block table, context lengths = positions + 1, source rows =
    the rows themselves (each row's input is its own output). kernels/decode_inputs.py does the same
    in one kernel on CUDA; this is its reference and the CPU's path."""
    pos = packed[1, :n] + 1
    col = torch.clamp(pos // block_size, max=tables.shape[1] - 1)
    block = tables[:n].gather(1, col[:, None]).squeeze(1).to(torch.long)
    packed[1, :n] = pos
    packed[2, :n] = block * block_size + pos % block_size
    packed[3, :n] = pos + 1
    packed[4, :n] = torch.arange(n, device=packed.device)


class DecodeGraphs:
    def __init__(self, engine, max_num_seqs: int, steps: int = 1, rows_share_kv: bool = False):
        """`rows_share_kv`: the graphs of speculative steps, whose rows are a sequence's input and its
        drafts (up to max_num_seqs rows in all): the attention's metadata says so (AttnMeta)."""
        if rows_share_kv and steps != 1:
            raise ValueError("a speculative step is one step: its next inputs are what it accepts")
        self.engine = engine
        self.rows_share_kv = rows_share_kv
        self.steps = steps  # decode steps a run() may replay back to back (> 1: the graphs advance their inputs)
        # bucket -> us of one replay at TIMED_CONTEXT positions, measured after capture (multi-step graphs)
        self.step_us: dict[int, float] = {}
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        dev = engine.device
        n, width = self.buckets[-1], engine.max_blocks_per_seq
        # ids, positions, slots, context lengths, source rows, LoRA slots: one [6, n] buffer, one copy per
        # step. A row whose source is >= 0 takes its input token from that row of the previous replay's
        # output (`prev`), on the device: the step was launched before that output was read back.
        self.packed = torch.zeros((6, n), dtype=torch.long, device=dev)
        self.packed[2] = engine.kv.scratch_block * engine.block_size
        self.packed[3] = 1
        self.packed[4] = -1
        self.ids, self.pos, self.slots, self.src = self.packed[0], self.packed[1], self.packed[2], self.packed[4]
        self.prev = torch.zeros(n, dtype=torch.long, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.full((n, width), engine.kv.scratch_block, dtype=torch.int32, device=dev)
        self.qstart = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.width = width
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits, argmax)
        # with LoRA slots, a second set computing the adapters' deltas, replayed only when some row has one:
        # a step of base-model rows then costs what it costs without slots
        self.graphs_lora: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs_lora: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        # pinned staging, filled through numpy views (no per-element torch calls); RING sets, since
        # with overlapped steps a set can still be in flight to the device while the next is filled
        pin = dev.type == "cuda"
        self.h_packed = [torch.zeros((6, n), dtype=torch.long, pin_memory=pin) for _ in range(RING)]
        self.h_tables = [torch.zeros((n, width), dtype=torch.int32, pin_memory=pin) for _ in range(RING)]
        self.np_packed = [x.numpy() for x in self.h_packed]
        self.np_tables = [x.numpy() for x in self.h_tables]
        for t in self.np_tables:
            t[:] = engine.kv.scratch_block
        self._staged = [[[] for _ in range(n)] for _ in range(RING)]  # per set: the rows it holds (lists)
        self._views: dict = {}
        self._out_views: dict = {}
        self._slot = 0
        # each set's copy to the device, recorded: a set is refilled only once its last copy has run (steps
        # that read nothing back, e.g. a long prompt's middle chunks as row-graph steps, may queue more
        # than RING runs ahead of the device)
        self._copied = [torch.cuda.Event() for _ in range(RING)] if pin else None
        # what the device's table buffer holds: (bucket, copies of the rows). The same rows again (a
        # decode step between two block boundaries): no refill, no copy
        self._tables_held: tuple | None = None

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.buckets[-1] and width <= self.width and bool(self.graphs)

    def _meta(self, b: int) -> AttnMeta:
        return AttnMeta(slot_mapping=self.slots[:b], block_tables=self.tables[:b], context_lens=self.ctx[:b],
                        query_start=self.qstart[:b + 1], max_query=1, q_lens=[1] * b, ctx_lens=[1] * b,
                        tables=[[0]] * b, rows_share_kv=self.rows_share_kv)

    def _forward(self, b: int, lora: bool = False):
        m = self.engine.model
        self.ctx[:b].copy_(self.packed[3, :b])  # int32 view for the kernel, inside the graph
        src = self.src[:b]
        ids = torch.where(src >= 0, self.prev.index_select(0, src.clamp(min=0)), self.ids[:b])
        # the LoRA set computes every row's delta (rows of slot 0 add exact zeros)
        hidden = m.forward(ids, self.pos[:b], self.engine.kv, self._meta(b), self.packed[5, :b] if lora else None)
        if self.engine.graph_fp32_logits:  # session 2's graph: an FP32 cast of [b, vocab], then the argmax
            logits = m.logits(hidden)
        else:
            # the argmax on the model's own (BF16) logits: the FP32 cast is exact, so the same token
            # (first index of the maximum either way), without a [b, vocab] FP32 write and re-read
            # in every step; the sampler upcasts when it needs more than the argmax
            logits = m.logits(hidden, upcast=False)
        if self.engine.argmax_kernel == "triton" and logits.is_cuda:
            from surge.engines.kernels.decoder_fused import argmax_rows

            tokens = argmax_rows(logits, pdl=m.pdl)
        else:
            tokens = logits.argmax(-1)
        self.prev[:b].copy_(tokens)
        if self.steps > 1:
            if self.packed.is_cuda:
                from surge.engines.kernels.decode_inputs import next_decode_inputs
            else:
                next_decode_inputs = next_decode_inputs_torch
            next_decode_inputs(self.packed, self.tables, b, self.engine.block_size)
        return logits, tokens

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        sets = [(False, self.graphs, self.outputs)]
        if self.engine.model.lora is not None:
            sets.append((True, self.graphs_lora, self.outputs_lora))
        with torch.cuda.stream(stream):
            for lora, graphs, outputs in sets:
                for b in reversed(self.buckets):  # largest first: the pool then fits the smaller ones
                    for _ in range(2):  # warm up (Triton compiles, cuBLAS picks algorithms)
                        self._forward(b, lora)
                    g = torch.cuda.CUDAGraph()
                    with capture(g, pool=self.pool, stream=stream):
                        outputs[b] = self._forward(b, lora)
                    if self.pool is None:
                        self.pool = g.pool()
                    graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.current_stream().synchronize()  # not the device's: engines/graph_capture.py
        if self.steps > 1:
            self._time_steps()

    def _time_steps(self) -> None:
        """Each bucket's step time with TIMED_CONTEXT positions of context (its rows reading the scratch
        block), the median of 3 replays after one: what a launch of several steps costs a step, for the
        engine's cap on a launch's duration. The buffers are put back afterwards."""
        e = self.engine
        saved = self.packed.clone()
        ctx = min(TIMED_CONTEXT, e.max_model_len) - 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for b, g in self.graphs.items():
            times = []
            for _ in range(4):
                self.packed.copy_(saved)
                self.packed[1, :b] = ctx
                self.packed[3, :b] = ctx + 1
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            self.step_us[b] = sorted(times[1:])[1]
        self.packed.copy_(saved)
        torch.cuda.current_stream().synchronize()  # not the device's: engines/graph_capture.py

    def _stage_tables(self, k: int, tables: list[list[int]], bucket: int) -> None:
        """Bring staging set k's table rows to `tables` (scratch blocks after each row and in padded
        rows), writing only the rows that differ from what the set holds: with streams of different
        lengths some sequence crosses a block boundary nearly every step, and rewriting all 64 rows
        each time was ~1 us a row of host time."""
        t, rows, scratch = self.np_tables[k], self._staged[k], self.engine.kv.scratch_block
        prev = None
        for i, row in enumerate(tables):
            old = rows[i]
            if row is prev:  # rows of one sequence (a prompt's tokens, drafts): its table converted once
                if old is not rows[i - 1]:
                    n = len(row)
                    t[i, :n] = t[i - 1, :n]
                    if len(old) > n:
                        t[i, n:len(old)] = scratch
                    rows[i] = rows[i - 1]
            elif old != row:
                n = len(row)
                t[i, :n] = row
                if len(old) > n:
                    t[i, n:len(old)] = scratch
                rows[i] = list(row)
            prev = row
        for i in range(len(tables), bucket):
            if rows[i]:
                t[i, :len(rows[i])] = scratch
                rows[i] = []

    def run(self, ids: list[int], pos: list[int], slots: list[int], tables: list[list[int]],
            src: list[int] | None = None, prev_tokens=None, steps: int = 1, each=None,
            adapters: list[int] | None = None):
        """One decode step of len(ids) sequences -> (logits [b, vocab] in the model's dtype, or FP32 with
        engine.graph_fp32_logits, greedy tokens [b]).
        `src[i] >= 0`: row i's input token is row src[i] of the previous replay's tokens (ids[i] is
        ignored); `prev_tokens`: those tokens when they came from an eager step instead.
        `steps` > 1 (graphs captured with steps >= that): that many decode steps, replayed back to back,
        each from the one before (the tables must hold the blocks of every position); `each(j, tokens)`
        is called after step j's replay is queued, to copy its tokens out before the next overwrites
        them; `adapters`: each row's LoRA slot (None: all 0); the last step's logits and tokens are returned."""
        if steps > self.steps:
            raise ValueError(f"{steps} steps a run, but the graphs were captured for {self.steps}")
        b = len(ids)
        bucket = next(x for x in self.buckets if x >= b)
        e = self.engine
        k = self._slot
        self._slot = (k + 1) % RING
        if self._copied is not None:
            self._copied[k].synchronize()  # (an event never recorded returns at once)
        p = self.np_packed[k]
        p[0, :b] = ids
        np.maximum(p[0, :b], 0, out=p[0, :b])  # placeholders (taken from `prev` on the device)
        p[0, b:bucket] = 0  # padded rows: a valid token (stale ids of a larger batch may be placeholders)
        p[1, b:bucket] = 0
        p[1, :b] = pos
        p[2, :b] = slots
        p[3, :b] = pos
        p[3, :b] += 1
        p[4, :bucket] = -1
        if src is not None:
            p[4, :b] = src
        if adapters is not None:  # (an engine without LoRA slots leaves the row at 0)
            p[5, b:bucket] = 0
            p[5, :b] = adapters
        if bucket > b:  # padded rows: one token of context, written to the scratch block
            p[2, b:bucket] = e.kv.scratch_block * e.block_size
            p[3, b:bucket] = 1
        held = self._tables_held
        same = held is not None and held[0] == bucket and held[1] == tables  # compared in C, row by row
        if not same:
            self._stage_tables(k, tables, bucket)
        if prev_tokens is not None:
            self.prev[:prev_tokens.shape[0]].copy_(prev_tokens)
        views = self._views.get((k, bucket))
        if views is None:  # slicing a tensor costs more host time than the copy's launch: once per (set, bucket)
            views = self._views[k, bucket] = (self.packed[:, :bucket], self.h_packed[k][:, :bucket],
                                              self.tables[:bucket], self.h_tables[k][:bucket])
        views[0].copy_(views[1], non_blocking=True)
        if not same:
            views[2].copy_(views[3], non_blocking=True)
            self._tables_held = (bucket, [list(row) for row in tables])
        if self._copied is not None:
            self._copied[k].record()
        lora = adapters is not None and any(adapters)
        graph = (self.graphs_lora if lora else self.graphs)[bucket]
        for j in range(steps):
            graph.replay()
            out = (self.outputs_lora if lora else self.outputs)[bucket]
            rows = self._out_views.get(b)
            if rows is None or rows[0] is not out:  # (outputs are replaced where graphs are replayed eagerly: tests)
                rows = self._out_views[b] = (out, out[0][:b], out[1][:b])
            if each is not None:
                each(j, rows[2])
        return rows[1], rows[2]
