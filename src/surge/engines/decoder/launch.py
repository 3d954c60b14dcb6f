"""Launched decode steps (runtime/scheduler/overlap.py): a step of greedy decodes started on the device
and its tokens read back later, so that the host schedules the next step meanwhile; several decode
steps in one launch where the multi-step CUDA graphs hold them.

A mixin of DecoderEngine (engines/decoder/runner.py), apart from it because the launch/collect
protocol (Launch, can_launch, launch, ready, collect) is the overlapped loop's alone; step() is the
synchronous path. Needs the engine's `device`, `block_size`, `max_num_seqs`, `graphs`, `model`, `kv`,
`decode_launch_ms`, `_pinned`, `_events`, `_slot`, `prepare`, `_adapters` and `_row_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from surge.engines.decoder.graphs import RING as _RING
from surge.engines.decoder.sampler import SampleOut
from surge.runtime.scheduler.step import ScheduledSeq


@dataclass
@dataclass
class Launch:
    """A decode step launched on the device, its greedy tokens not read back yet."""

    seq_ids: list[int]
    rows: dict[int, int]  # seq_id -> row of `tokens`
    tokens: torch.Tensor  # [b] on the device
    host: torch.Tensor | None = None  # pinned [steps * b] copy, valid once `event` completes
    event: object = None
    graph: bool = False
    steps: int = 1  # decode steps run by the launch; `host` holds their tokens step-major


class DecodeLaunches:
    def can_launch(self, scheduled: list[ScheduledSeq]) -> bool:
        """A step of greedy decodes only, whose tokens can stay on the device until collect()."""
        return bool(scheduled) and all(s.num_tokens == 1 and s.sample and s.seq.fast for s in scheduled)

    def launch_steps(self, scheduled: list[ScheduledSeq]) -> int:
        """The most decode steps one launch of `scheduled` can run: the graphs' (multi-step launches
        replay a captured graph), fewer where decode_launch_ms would be passed at the step time the
        batch's bucket measured (DecodeGraphs.step_us), 1 where the step would run eagerly."""
        g = self.graphs
        if g is None or not g.fits(len(scheduled), max(len(s.seq.block_table) for s in scheduled)):
            return 1
        return self.steps_for(len(scheduled))

    def steps_for(self, batch: int) -> int:
        """Decode steps a graph launch of `batch` sequences runs: the graphs' steps, fewer where
        decode_launch_ms would be passed at the step time the batch's bucket measured; 1 without
        multi-step graphs or past the largest bucket."""
        g = self.graphs
        if g is None or g.steps == 1 or batch > g.buckets[-1]:
            return 1
        us = g.step_us.get(next(x for x in g.buckets if x >= batch)) if self.decode_launch_ms else None
        if us:  # tokens reach a stream a launch at a time: a launch no longer than decode_launch_ms
            return max(1, min(g.steps, int(self.decode_launch_ms * 1e3 // us)))
        return g.steps

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], prev: Launch | None, steps: int = 1) -> Launch:
        """Start a decode step (or `steps` of them, at most launch_steps(scheduled); the blocks of every
        position must be in the tables); a sequence in `prev` takes its input token from prev's
        output on the device (its host token is a placeholder). Returns at once on a GPU (the step
        runs behind)."""
        bs = self.block_size
        seqs = [s.seq for s in scheduled]
        seq_ids = [q.seq_id for q in seqs]
        pos = [s.start for s in scheduled]
        ids = [q.token_ids[p] for q, p in zip(seqs, pos)]
        b = len(seqs)
        src = rows = None
        if prev is not None:
            if prev.seq_ids == seq_ids:  # the same batch as the step in flight (the steady state)
                src, rows = list(range(b)), prev.rows
            else:
                src = [prev.rows.get(sid, -1) for sid in seq_ids]
        if rows is None:
            rows = dict(zip(seq_ids, range(b)))
            for i, t in enumerate(ids):
                if t < 0 and (src is None or src[i] < 0):
                    raise RuntimeError(f"sequence {seq_ids[i]}: input token not sampled yet and not in flight")
        tables = [q.block_table for q in seqs]
        use_graph = self.graphs is not None and self.graphs.fits(b, max(map(len, tables))) \
            and (prev is None or prev.graph or len(prev.seq_ids) <= self.graphs.buckets[-1])
        if steps > 1 and not use_graph:
            raise ValueError("a launch of several decode steps needs the step's CUDA graph")
        cuda = self.device.type == "cuda"
        host = None
        if cuda:
            k = self._slot
            self._slot = (k + 1) % _RING
            if len(self._pinned) < _RING or self._pinned[k].shape[0] < steps * b:
                size = max(steps * b, self.graphs.steps * self.max_num_seqs if self.graphs else self.max_num_seqs)
                self._pinned = [torch.empty(size, dtype=torch.long, pin_memory=True) for _ in range(_RING)]
            host = self._pinned[k][:steps * b]
        if use_graph:
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
            prev_tokens = prev.tokens if prev is not None and not prev.graph else None
            if cuda:
                def each(j, t):  # a step's tokens out before the next replay overwrites them
                    host[j * b:(j + 1) * b].copy_(t, non_blocking=True)
            else:  # graphs driven on the host (tests): the next replay reuses the buffer
                kept = []

                def each(j, t):
                    kept.append(t.clone())
            _, tokens = self.graphs.run(ids, pos, slots, tables, src, prev_tokens, steps=steps, each=each,
                                        adapters=self._row_slots(seqs))
            if not cuda:
                tokens, host = kept[-1], torch.cat(kept)
        else:
            tokens = self._eager_decode(scheduled, ids, src, prev)
            if cuda:
                host.copy_(tokens, non_blocking=True)
        out = Launch(seq_ids, rows, tokens, host, graph=use_graph, steps=steps)
        if cuda:
            out.event = self._events[k]
            out.event.record()
        return out

    def _eager_decode(self, scheduled, ids, src, prev) -> torch.Tensor:
        _, pos, slots, q_lens, ctx, tables, table_np, qstart = self.prepare(scheduled)
        dev = self.device
        meta = self.attn_meta(slots, table_np, ctx, qstart, q_lens, tables)  # a decode: max_query 1
        ids_t = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        if src is not None and any(i >= 0 for i in src):
            src_t = torch.tensor(src, dtype=torch.long).to(dev, non_blocking=True)
            ids_t = torch.where(src_t >= 0, prev.tokens.index_select(0, src_t.clamp(min=0)), ids_t)
        hidden = self.model.forward(ids_t, torch.from_numpy(pos).to(dev, non_blocking=True), self.kv, meta,
                                    self._adapters(scheduled))
        return self.model.logits(hidden).argmax(-1)

    def collect(self, launch: Launch) -> dict[int, SampleOut]:
        """The launched step's tokens (waits for the device); a one-step launch's."""
        if launch.steps != 1:
            raise ValueError("collect() reads a one-step launch; collect_tokens() reads every step's")
        return {sid: SampleOut(t) for sid, t in zip(launch.seq_ids, self.collect_tokens(launch))}

    def ready(self, launch: Launch) -> bool:
        """Whether collect_tokens(launch) would return without waiting for the device."""
        return launch.event is None or launch.event.query()

    def collect_tokens(self, launch: Launch) -> list[int]:
        """collect() as plain token ids in launch.seq_ids' order (no object per token)."""
        if launch.event is not None:
            launch.event.synchronize()
            return launch.host.tolist()
        return (launch.host if launch.host is not None else launch.tokens).tolist()
