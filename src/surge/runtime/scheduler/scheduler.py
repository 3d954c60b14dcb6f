"""The iteration scheduler: which sequences compute how many tokens in the next step.

One step mixes decodes (one token per running sequence) and prefill chunks of
new sequences, within a token budget (chunked prefill: a long prompt is split
over several steps so that running streams keep their pace). Running sequences
go first, oldest first; a sequence that cannot get a block preempts the newest
running one (its blocks are freed; it is recomputed later, mostly from the
prefix cache). Waiting sequences are admitted, oldest first, while the budget,
the sequence limit and the free blocks allow.

With policy "priority" (vLLM's `--scheduling-policy priority`) each sequence has its request's
priority (SamplingParams.priority; lower first, 0 by default): sequences wait in (priority,
arrival) order and a sequence that cannot get a block preempts the running one of the lowest
priority (the newest among equals) instead; as in vLLM, a waiting sequence never preempts.

schedule() -> the engine runs the step -> update(samples): vLLM's three-line loop.
Overlapped steps (launched_steps.py) and speculative ones (speculative_steps.py) resolve their
tokens through mixins of Scheduler; what a step is made of is in step.py.

A step that raises (a bad row, a guide's matcher, an asynchronous device error) is contained per sequence
(StepLoop.contain): its live sequences lose what the step would have given them and their KV blocks (a
preemption's recompute) and wait in the quarantine, out of the waiting queue. While it holds any, each iteration
runs its first sequence's step alone (solo(); a long context recomputed over several), then the batch of everyone
else (schedule(): the running sequences outside the quarantine, and admissions), so one bad request does not
stall the others' tokens nor the queue; a sequence rejoins the batches once its step alone has sampled a token.
One whose step alone raises fails; its neighbours do not. The quarantine's head is never preempted by the batch
(it would lose its recompute and take the blocks back from the batch the next iteration): a batch that runs
short of blocks preempts among its own sequences, as without a quarantine.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from surge.runtime.scheduler.block_manager import BlockManager
from surge.runtime.scheduler.launched_steps import LaunchedSteps
from surge.runtime.scheduler.sequence import PLACEHOLDER, SeqStatus, Sequence
from surge.runtime.scheduler.speculative_steps import SpeculativeSteps
from surge.runtime.scheduler.step import Finished, ScheduledSeq

# a failed step contained (StepLoop.contain): how many times one sequence may be set apart to run alone (each
# time it makes a token's progress, so this only bounds the recomputes of an engine whose batched steps keep
# failing), and how many steps alone in a row may raise before the engine is taken as broken (the rest of the
# quarantine then fails at once instead of a step each)
MAX_RETRIES = 3
BROKEN_AFTER = 3


@dataclass
class SchedulerConfig:
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 64  # running at once
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_model_len: int = 2048  # prompt + output
    prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority": waiting order and preemption by the requests' priorities

    def __post_init__(self):
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, not {self.policy!r}")
        # a sequence cannot outgrow the whole KV cache: past it, it would preempt itself and never be
        # admitted again (the waiting queue behind it starved), so it ends there as at the context's end
        self.max_model_len = min(self.max_model_len, self.num_blocks * self.block_size)


POLICIES = ("fcfs", "priority")


def _rank(seq: Sequence) -> tuple:
    """A sequence's place under the priority policy: lower priority values first, then arrival."""
    return seq.params.priority, seq.arrival, seq.seq_id


class Scheduler(LaunchedSteps, SpeculativeSteps):
    def __init__(self, config: SchedulerConfig, eos_token_ids=(), adapters=None):
        """`adapters` (runtime/scheduler/adapters.AdapterSlots): LoRA slots given at admission, when the
        engine has them."""
        self.config = config
        self.adapters = adapters
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        self.eos = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._preempted = False  # the last schedule() preempted
        # sequences of a failed step, each to run a step alone (oldest first); their count, and the steps alone
        # that raised since the last one that did not
        self.quarantine: deque[Sequence] = deque()
        self.retries = 0
        self.solo_failures = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.quarantine)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens leaves no room (max_model_len "
                             f"{self.config.max_model_len})")
        if self.config.block_size * self.config.num_blocks < seq.num_tokens + 1:
            raise ValueError("prompt does not fit in the KV cache")
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: at its back (a new arrival) or front (a preempted sequence) under
        fcfs; at its (priority, arrival) place under the priority policy."""
        if self.config.policy == "priority":
            rank = _rank(seq)
            i = len(self.waiting)
            while i > 0 and _rank(self.waiting[i - 1]) > rank:
                i -= 1
            self.waiting.insert(i, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _victim(self) -> Sequence:
        """Who gives up its blocks when a running sequence of the batch needs one: the newest (fcfs), or the
        lowest priority, the newest among equals (priority); never the quarantine's head, running alone (the one
        that needs the block is itself a candidate, so there is always one)."""
        running = self.running
        if self.quarantine:
            head = self.quarantine[0]
            running = [s for s in running if s is not head]
        if self.config.policy == "priority":
            return max(running, key=_rank)
        return running[-1]

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
        if self.quarantine and seq in self.quarantine:
            self.quarantine.remove(seq)
        self.blocks.release(seq)
        if self.adapters is not None:
            if seq.status is SeqStatus.RUNNING:
                self.adapters.release(seq)
            uid = seq.adapter_uid
            if uid in self.adapters.retired and not self._uses_adapter(uid, seq):
                self.adapters.drop(uid)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _uses_adapter(self, uid: int, but: Sequence | None = None) -> bool:
        return any(s.adapter_uid == uid and s is not but for s in (*self.waiting, *self.running, *self.quarantine))

    def forget_adapter(self, uid: int) -> None:
        """A LoRA adapter unregistered: dropped now, or when its last waiting or running sequence ends."""
        if self.adapters is not None:
            self.adapters.forget(uid, in_use=self._uses_adapter(uid))

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        if self.adapters is not None:
            self.adapters.release(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self._enqueue(seq, front=True)

    def isolate(self, seq: Sequence, blamed: bool = True) -> None:
        """After a step that raised: `seq` (running; its launched tokens not read back are cut, the step's
        other effects were never applied) gives up its KV blocks, as a preempted sequence does, and waits in the
        quarantine to run a step alone; it continues from the tokens it has (those handed out). `blamed` False:
        another row was at fault: it waits at the front of the queue instead, as a preempted sequence, and this
        does not count towards its MAX_RETRIES."""
        if seq.status is SeqStatus.FINISHED:
            return
        if PLACEHOLDER in seq.token_ids:  # launched and never read back: always the last ones
            at = seq.token_ids.index(PLACEHOLDER)
            del seq.token_ids[at:]
            del seq.output_ids[at - seq.num_prompt:]
        seq.draining = False
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.release(seq)
            if self.adapters is not None:
                self.adapters.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1  # (its blocks went: a draft model's K/V with them, draft_model.py)
        self.retries += 1
        if not blamed:
            # nothing of its own to prove alone: back to the batches as a preempted sequence is (through the
            # quarantine, one request's rejected guide would cost every neighbour a step run by itself)
            if seq in self.quarantine:
                self.quarantine.remove(seq)
            self._enqueue(seq, front=True)
            return
        seq.retries += 1
        if seq not in self.quarantine:
            self.quarantine.append(seq)

    def solo(self) -> list[ScheduledSeq]:
        """The quarantine's first sequence, alone (a step of its own, run before the batch's: schedule()): its
        next chunk (its context is recomputed, from the prefix cache where it can). A running sequence of the
        batch gives up its blocks (or its LoRA slot) if the sequence needs them."""
        seq = self.quarantine[0]
        admit = seq.status is SeqStatus.WAITING
        if admit:
            self.blocks.allocate_prefix(seq)
            while self.adapters is not None and not self.adapters.acquire(seq):
                self._evict_for(seq)
        start, total = seq.num_computed, seq.num_tokens
        n = min(total - start, self.config.max_num_batched_tokens)
        while not self.blocks.ensure(seq, start + n):
            self._evict_for(seq)
        if admit:
            self._start(seq)
        return [ScheduledSeq(seq, start, n, start + n == total)]

    def _start(self, seq: Sequence) -> None:
        """An admitted sequence runs (its prefix-cache lookup counted, where it made one: BlockManager.looks_up)."""
        if self.blocks.looks_up(seq):
            self.blocks.queried_tokens += seq.num_tokens
            self.blocks.hit_tokens += seq.num_cached_prompt
        seq.status = SeqStatus.RUNNING
        if not seq.scheduled_at:
            seq.scheduled_at = time.monotonic()
        self.running.append(seq)

    def _evict_for(self, seq: Sequence) -> None:
        others = [s for s in self.running if s is not seq]
        if not others:  # a sequence alone always fits (add(), max_model_len): only a LoRA slot could be missing
            raise RuntimeError(f"sequence {seq.seq_id} cannot run alone")
        victim = max(others, key=_rank) if self.config.policy == "priority" else others[-1]
        self.running.remove(victim)
        self._preempt(victim)

    def schedule(self) -> list[ScheduledSeq]:
        """The batch's step: the running sequences (but the quarantine's head, which runs alone: solo()) and
        the waiting ones admitted."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        running, blocks = self.running, self.blocks
        # of the quarantine, only its head may be running (recomputed alone, over several steps for a long
        # context); the others wait for their step alone, out of the waiting queue
        alone = self.quarantine[0] if self.quarantine else None
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.draining or seq is alone:  # its last token is in flight (overlapped steps), or it runs alone
                i += 1
                continue
            start, total = seq.num_computed, len(seq.token_ids)
            n = min(total - start, budget)
            while not blocks.ensure(seq, start + n):
                victim = self._victim()
                at = running.index(victim)
                del running[at]
                if at < i:  # scheduled earlier in this step (priority policy): its entry is dropped below
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, start, n, start + n == total))
                budget -= n
                i += 1
        self._preempted = preempted
        if preempted:
            # the preempted ones were scheduled earlier in the list: drop their entries
            out = [s for s in out if s.seq.status is SeqStatus.RUNNING]
            return out
        return out + self._admit(budget)

    def admit(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """`scheduled` (this step's, from schedule(), less what ended since) and the waiting sequences
        that now fit in the step's token budget: those added, or given room, after it was made (the
        overlapped loop drains its launches in flight before a prefill step, and what arrived
        meanwhile joins that step instead of waiting for a step of its own). Nothing is admitted
        after a preemption in schedule(): the preempted would come straight back."""
        if self._preempted:
            return scheduled
        budget = self.config.max_num_batched_tokens - sum(s.num_tokens for s in scheduled)
        return scheduled + self._admit(budget)

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        cfg, out = self.config, []
        i = 0  # waiting sequences whose LoRA adapter cannot have a slot now are passed over
        while i < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[i]
            self.blocks.allocate_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.ensure(seq, seq.num_computed + n):
                self.blocks.release(seq)
                break
            if self.adapters is not None and not self.adapters.acquire(seq):
                self.blocks.release(seq)
                i += 1
                continue
            del self.waiting[i]
            self._start(seq)
            out.append(ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
            budget -= n
        return out

    def update(self, scheduled: list[ScheduledSeq], samples: dict[int, int]) -> list[Finished]:
        """Advance the sequences after a step; `samples` maps seq_id -> the token sampled."""
        finished = []
        quarantine = self.quarantine
        if self.solo_failures:  # the engine ran a step: not broken
            self.solo_failures = 0
        for s in scheduled:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed = s.start + s.num_tokens
            self.blocks.commit(seq)
            if quarantine and seq is quarantine[0] and s.sample:  # its step alone sampled: it rejoins the batches
                quarantine.popleft()
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

    def stop_reason(self, seq: Sequence, token: int, at: int | None = None) -> str | None:
        """Why `seq` stops after `token` (at index `at` of its tokens, by default the last one)."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            return "stop"
        at = seq.num_tokens - 1 if at is None else at
        if at + 1 - seq.num_prompt >= p.max_tokens or at + 1 >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence from outside (a stop string matched)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._finish(seq, reason)
        else:
            self.abort(seq, reason)
