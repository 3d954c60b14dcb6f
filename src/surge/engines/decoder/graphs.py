"""CUDA graphs of the decode step, one per batch-size bucket.

A decode step is the same kernels every time for a given batch size; replaying
a captured graph removes the launch overhead of several hundred small kernels
(the step's cost at small batches). Inputs are copied into static buffers;
padded rows write their K/V into the cache's scratch block and are not sampled.
The attention kernel reads the context lengths and block tables from the
buffers, so one graph serves any context length up to max_model_len.
"""

from __future__ import annotations

import numpy as np
import torch

from surge.engines.decoder.attention import AttnMeta

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, engine, max_num_seqs: int):
        self.engine = engine
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        dev = engine.device
        n, width = self.buckets[-1], engine.max_blocks_per_seq
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), engine.kv.scratch_block * engine.block_size, dtype=torch.long, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.full((n, width), engine.kv.scratch_block, dtype=torch.int32, device=dev)
        self.qstart = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.width = width
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        # pinned staging: one host->device copy per input
        self.h_ids = torch.zeros(n, dtype=torch.long).pin_memory()
        self.h_pos = torch.zeros(n, dtype=torch.long).pin_memory()
        self.h_slots = torch.zeros(n, dtype=torch.long).pin_memory()
        self.h_ctx = torch.ones(n, dtype=torch.int32).pin_memory()
        self.h_tables = torch.zeros((n, width), dtype=torch.int32).pin_memory()

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.buckets[-1] and width <= self.width and bool(self.graphs)

    def _meta(self, b: int) -> AttnMeta:
        return AttnMeta(slot_mapping=self.slots[:b], block_tables=self.tables[:b], context_lens=self.ctx[:b],
                        query_start=self.qstart[:b + 1], max_query=1, q_lens=[1] * b, ctx_lens=[1] * b,
                        tables=[[0]] * b)

    def _forward(self, b: int) -> torch.Tensor:
        m = self.engine.model
        hidden = m.forward(self.ids[:b], self.pos[:b], self.engine.kv, self._meta(b))
        return m.logits(hidden)

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

    def run(self, ids, pos, slots, ctx, table_np) -> torch.Tensor:
        b = len(ids)
        bucket = next(x for x in self.buckets if x >= b)
        e = self.engine
        self.h_ids[:b] = torch.as_tensor(ids)
        self.h_pos[:b] = torch.from_numpy(pos)
        self.h_slots[:b] = torch.from_numpy(slots)
        self.h_slots[b:bucket] = e.kv.scratch_block * e.block_size
        self.h_ctx[:b] = torch.as_tensor(ctx, dtype=torch.int32)
        self.h_ctx[b:bucket] = 1
        self.h_tables[:bucket] = e.kv.scratch_block
        self.h_tables[:b, :table_np.shape[1]] = torch.from_numpy(table_np)
        self.ids[:bucket].copy_(self.h_ids[:bucket], non_blocking=True)
        self.pos[:bucket].copy_(self.h_pos[:bucket], non_blocking=True)
        self.slots[:bucket].copy_(self.h_slots[:bucket], non_blocking=True)
        self.ctx[:bucket].copy_(self.h_ctx[:bucket], non_blocking=True)
        self.tables[:bucket].copy_(self.h_tables[:bucket], non_blocking=True)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]
