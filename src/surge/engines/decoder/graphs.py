"""CUDA graphs of the decode step, one per batch-size bucket.

A decode step is the same kernels every time for a given batch size; replaying
a captured graph removes the launch overhead of several hundred small kernels
(the step's cost at small batches). Inputs are copied into static buffers;
padded rows write their K/V into the cache's scratch block and are not sampled.
The attention kernel reads the context lengths and block tables from the
buffers, so one graph serves any context length up to max_model_len.
"""

from __future__ import annotations

import torch

from surge.engines.decoder.attention import AttnMeta

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, engine, max_num_seqs: int):
        self.engine = engine
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        dev = engine.device
        n, width = self.buckets[-1], engine.max_blocks_per_seq
        # ids, positions, slots, context lengths: one [4, n] buffer, one copy per step
        self.packed = torch.zeros((4, n), dtype=torch.long, device=dev)
        self.packed[2] = engine.kv.scratch_block * engine.block_size
        self.packed[3] = 1
        self.ids, self.pos, self.slots = self.packed[0], self.packed[1], self.packed[2]
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.full((n, width), engine.kv.scratch_block, dtype=torch.int32, device=dev)
        self.qstart = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.width = width
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits, argmax)
        self.pool = None
        # pinned staging, filled through numpy views (no per-element torch calls)
        pin = dev.type == "cuda"
        self.h_packed = torch.zeros((4, n), dtype=torch.long, pin_memory=pin)
        self.h_tables = torch.zeros((n, width), dtype=torch.int32, pin_memory=pin)
        self.np_packed = self.h_packed.numpy()
        self.np_tables = self.h_tables.numpy()

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.buckets[-1] and width <= self.width and bool(self.graphs)

    def _meta(self, b: int) -> AttnMeta:
        return AttnMeta(slot_mapping=self.slots[:b], block_tables=self.tables[:b], context_lens=self.ctx[:b],
                        query_start=self.qstart[:b + 1], max_query=1, q_lens=[1] * b, ctx_lens=[1] * b,
                        tables=[[0]] * b)

    def _forward(self, b: int):
        m = self.engine.model
        self.ctx[:b].copy_(self.packed[3, :b])  # int32 view for the kernel, inside the graph
        hidden = m.forward(self.ids[:b], self.pos[:b], self.engine.kv, self._meta(b))
        logits = m.logits(hidden)
        return logits, logits.argmax(-1)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first: the pool then fits the smaller ones
                for _ in range(2):  # warm up (Triton compiles, cuBLAS picks algorithms)
                    self._forward(b)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self.outputs[b] = self._forward(b)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, ids: list[int], pos: list[int], slots: list[int], tables: list[list[int]]):
        """One decode step of len(ids) sequences -> (logits [b, vocab] fp32, greedy tokens [b])."""
        b = len(ids)
        bucket = next(x for x in self.buckets if x >= b)
        e = self.engine
        p, t = self.np_packed, self.np_tables
        p[0, :b] = ids
        p[1, :b] = pos
        p[2, :b] = slots
        p[3, :b] = pos
        p[3, :b] += 1
        if bucket > b:  # padded rows: one token of context, written to the scratch block
            p[2, b:bucket] = e.kv.scratch_block * e.block_size
            p[3, b:bucket] = 1
        t[:bucket] = e.kv.scratch_block
        for i, row in enumerate(tables):
            t[i, :len(row)] = row
        self.packed[:, :bucket].copy_(self.h_packed[:, :bucket], non_blocking=True)
        self.tables[:bucket].copy_(self.h_tables[:bucket], non_blocking=True)
        self.graphs[bucket].replay()
        logits, tokens = self.outputs[bucket]
        return logits[:b], tokens[:b]
