"""The iteration scheduler: which sequences compute how many tokens in the next step.

One step mixes decodes (one token per running sequence) and prefill chunks of
new sequences, within a token budget (chunked prefill: a long prompt is split
over several steps so that running streams keep their pace). Running sequences
go first, oldest first; a sequence that cannot get a block preempts the newest
running one (its blocks are freed; it is recomputed later, mostly from the
prefix cache). Waiting sequences are admitted, oldest first, while the budget,
the sequence limit and the free blocks allow.

schedule() -> the engine runs the step -> update(samples): vLLM's three-line loop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from surge.runtime.scheduler.block_manager import BlockManager
from surge.runtime.scheduler.sequence import Sequence, SeqStatus


@dataclass
class SchedulerConfig:
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 64  # running at once
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_model_len: int = 2048  # prompt + output
    prefix_caching: bool = True

    def __post_init__(self):
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first token computed this step
    num_tokens: int
    sample: bool  # the chunk reaches the sequence's end: a new token is sampled


@dataclass
class Finished:
    seq: Sequence
    reason: str


class Scheduler:
    def __init__(self, config: SchedulerConfig, eos_token_ids=()):
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        self.eos = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens leaves no room (max_model_len "
                             f"{self.config.max_model_len})")
        if self.config.block_size * self.config.num_blocks < seq.num_tokens + 1:
            raise ValueError("prompt does not fit in the KV cache")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Drop a sequence wherever it is; its blocks are free at once."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.blocks.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledSeq]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.ensure(seq, seq.num_computed + n):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
                budget -= n
                i += 1
        if preempted:
            # the preempted ones were scheduled earlier in the list: drop their entries
            out = [s for s in out if s.seq.status is SeqStatus.RUNNING]
            return out
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.allocate_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.ensure(seq, seq.num_computed + n):
                self.blocks.release(seq)
                break
            self.waiting.popleft()
            self.blocks.queried_tokens += seq.num_tokens
            self.blocks.hit_tokens += seq.num_cached_prompt
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
            budget -= n
        return out

    def update(self, scheduled: list[ScheduledSeq], samples: dict[int, int]) -> list[Finished]:
        """Advance the sequences after a step; `samples` maps seq_id -> the token sampled."""
        finished = []
        for s in scheduled:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed = s.start + s.num_tokens
            self.blocks.commit(seq)
            if not s.sample:
                continue
            token = samples[seq.seq_id]
            seq.append(token)
            reason = self.stop_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(Finished(seq, reason))
        return finished

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence from outside (a stop string matched)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._finish(seq, reason)
        else:
            self.abort(seq, reason)
