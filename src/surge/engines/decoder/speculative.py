"""Speculative steps (runtime/scheduler/ngram.py, draft_model.py): draft tokens checked by the model in one
step (verify), and, as a draft model, k greedy tokens proposed in one launch (draft_tokens).

A mixin of DecoderEngine (engines/decoder/runner.py), apart from it because only speculative decoding
runs a step whose rows share a sequence, each at its own position. Needs the engine's `device`,
`block_size`, `graphs`, `row_graphs`, `model`, `kv`, `sampler`, `_rows`, `launch` and `collect_tokens`.
"""

from __future__ import annotations

import numpy as np
import torch

from surge.engines.decoder.attention import AttnMeta
from surge.runtime.scheduler.step import ScheduledSeq


class SpeculativeRows:
    @torch.inference_mode()
    def verify(self, scheduled: list[ScheduledSeq], drafts: list[list[int]]) -> list[list[int]]:
        """One decode step that also checks draft tokens: scheduled[i] (a decode: one input token at
        s.start, a sequence without penalties, guides or logprobs) followed by drafts[i] (the tables must
        hold the blocks of every draft's position). -> for each sequence: greedy, the model's greedy token
        after its input and after each of its drafts (len(drafts[i]) + 1 tokens), each computed as if the
        drafts before it were the sequence's tokens; sampled, the drafts it keeps and one drawn token
        (Sampler.speculative); either way Scheduler.accept reads the new tokens off it. The K/V of every
        row is in the cache (the scheduler keeps those it accepts). Each draft is a row of the step at its
        own position, attending to its sequence's cache up to itself: on a GPU a replay of the CUDA graph
        of the rows' bucket (engine.row_graphs)."""
        ids, pos, slots, tables, lora = self._rows(
            [(s.seq, s.start, [s.seq.token_ids[s.start]] + d) for s, d in zip(scheduled, drafts)])
        counts = [len(d) + 1 for d in drafts]
        g = self.row_graphs
        if g is not None and g.fits(len(ids), max(map(len, tables))):
            logits, tokens = g.run(ids, pos, slots, tables, adapters=lora)
        else:
            logits, tokens = self._eager_rows(ids, pos, slots, tables, lora)
        flat = tokens.tolist()
        out, i, items = [], 0, []
        for s, d, n in zip(scheduled, drafts, counts):
            out.append(flat[i:i + n])
            if not s.seq.params.greedy:
                items.append((i, s.seq, d))
            i += n
        if items:
            drawn = iter(self.sampler.speculative(logits, items))
            out = [next(drawn) if not s.seq.params.greedy else o for s, o in zip(scheduled, out)]
        return out

    @torch.inference_mode()
    def draft_tokens(self, scheduled: list[ScheduledSeq], counts: list[int]) -> list[list[int]]:
        """As a draft model: counts[i] greedy tokens after scheduled[i]'s input (a decode at s.start; the
        tables hold the blocks of every position), each from the one before; the K/V of the input and of
        every token but the last are written. One multi-step graph launch where the graphs hold it (every
        row the same count), else a step at a time, eagerly."""
        steps, b = max(counts), len(scheduled)
        g = self.graphs
        if g is not None and g.steps >= steps and min(counts) == steps \
                and g.fits(b, max(len(s.seq.block_table) for s in scheduled)):
            rows = [ScheduledSeq(s.seq, s.start, 1, True) for s in scheduled]
            got = self.collect_tokens(self.launch(rows, None, steps) if steps > 1 else self.launch(rows, None))
            return [[got[j * b + i] for j in range(steps)] for i in range(b)]
        bs = self.block_size
        out: list[list[int]] = [[] for _ in scheduled]
        prev = [s.seq.token_ids[s.start] for s in scheduled]
        for j in range(steps):
            live = [i for i, c in enumerate(counts) if c > j]
            pos = [scheduled[i].start + j for i in live]
            tables = [scheduled[i].seq.block_table for i in live]
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
            _, tokens = self._eager_rows([prev[i] for i in live], pos, slots, tables, None)
            for i, t in zip(live, tokens.tolist()):
                out[i].append(t)
                prev[i] = t
        return out

    def _eager_rows(self, ids, pos, slots, tables, adapters) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, greedy tokens) of decode rows that may share a sequence (verify() without a graph)."""
        dev = self.device
        width = max(len(t) for t in tables)
        table_np = np.full((len(tables), width), self.kv.scratch_block, dtype=np.int32)
        for i, t in enumerate(tables):
            table_np[i, :len(t)] = t
        ctx = [p + 1 for p in pos]
        meta = AttnMeta(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(table_np).to(dev, non_blocking=True),
            context_lens=torch.tensor(ctx, dtype=torch.int32).to(dev, non_blocking=True),
            query_start=torch.arange(len(ids) + 1, dtype=torch.int32).to(dev, non_blocking=True),
            max_query=1, q_lens=[1] * len(ids), ctx_lens=ctx, tables=tables, rows_share_kv=True)
        lora = None
        if adapters is not None and any(adapters):
            lora = torch.tensor(adapters, dtype=torch.long).to(dev, non_blocking=True)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
                                    torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True), self.kv, meta,
                                    lora)
        logits = self.model.logits(hidden)
        return logits, logits.argmax(-1)
