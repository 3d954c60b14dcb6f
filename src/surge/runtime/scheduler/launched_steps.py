"""The scheduler's side of overlapped steps: advance() at launch, resolve() when the step's tokens
are read back (the loop: runtime/scheduler/overlap.py).

A mixin of Scheduler, apart from scheduler.py because it is a concern of its own: a launched step's
tokens are placeholders in the sequences until the device's answer is read, and only these methods
put them there and take them out. Needs the Scheduler's `config`, `blocks`, `running`, `quarantine`,
`solo_failures`, `stop_reason` and `_finish`.
"""

from __future__ import annotations

from surge.runtime.scheduler.sequence import PLACEHOLDER, SeqStatus
from surge.runtime.scheduler.step import Finished, ScheduledSeq


class LaunchedSteps:
    def decode_fits(self, steps: int = 1) -> bool:
        """The next step can be scheduled before the running one's tokens are known: every running
        sequence decodes and keeps its tokens on the device, and each gets the blocks its next
        `steps` tokens need without preempting anyone (a preempted sequence would be recomputed from
        a placeholder). A waiting sequence admitted by that schedule makes the step a prefill, which
        the loop runs synchronously after reading the running step back. The quarantine's head, recomputed
        alone, is no part of the batch's step."""
        bs, need, ahead = self.config.block_size, 0, steps - 1
        alone = self.quarantine[0] if self.quarantine else None
        for seq in self.running:
            if seq.draining or seq is alone:
                continue
            if not seq.fast or len(seq.token_ids) - seq.num_computed != 1:
                return False
            over = (seq.num_computed + ahead) // bs + 1 - len(seq.block_table)
            if over > 0:
                need += over
        return need <= self.blocks.num_free

    def launch_steps(self, scheduled: list[ScheduledSeq], most: int) -> int:
        """How many decode steps one launch of `scheduled` may run (at most `most`): none of its
        sequences may pass its max_tokens or max_model_len inside the launch, so a launch never
        computes a token nobody may get (stops found on the way still drop the launch's rest)."""
        limit = self.config.max_model_len
        k = most
        for s in scheduled:
            seq = s.seq
            k = min(k, seq.params.max_tokens - len(seq.output_ids), limit - len(seq.token_ids))
        return max(1, k)

    def reserve(self, scheduled: list[ScheduledSeq], steps: int) -> None:
        """The blocks of `steps` decode tokens a sequence (schedule() took those of the first);
        decode_fits(steps) said they are free."""
        for s in scheduled:
            if not self.blocks.ensure(s.seq, s.start + steps):
                raise RuntimeError(f"sequence {s.seq.seq_id}: no block for a launched step")

    def advance(self, scheduled: list[ScheduledSeq], steps: int = 1) -> None:
        """A step (or `steps` decode steps in one launch) was launched: its sampled tokens are
        placeholders until resolve()."""
        limit = self.config.max_model_len
        for s in scheduled:
            seq = s.seq
            seq.num_computed = s.start + s.num_tokens + steps - 1
            if s.sample:
                seq.token_ids.extend([PLACEHOLDER] * steps)
                seq.output_ids.extend([PLACEHOLDER] * steps)
                if len(seq.output_ids) >= seq.params.max_tokens or len(seq.token_ids) >= limit:
                    seq.draining = True  # its last token: no further step

    def resolve(self, scheduled: list[ScheduledSeq], samples: dict[int, int]) -> list[Finished]:
        """resolve_rows() with the tokens given by sequence id."""
        return self.resolve_rows(scheduled, [samples.get(s.seq.seq_id) for s in scheduled])[1]

    def resolve_rows(self, scheduled: list[ScheduledSeq], tokens: list[int],
                     step: int = 0) -> tuple[dict[int, int], list[Finished]]:
        """A launched step's tokens are known (as read back: one per scheduled sequence, in order): put
        them in place of the placeholders, commit the full blocks, finish the sequences that stop.
        `step`: which of a multi-step launch's decode steps they are (0 first; resolved in order).
        -> (the tokens of the sequences that sampled and are still running {seq_id: token}, the
        finished). A sequence that stopped here may already be in a later launched step: that step's
        token for it is dropped (its status is FINISHED)."""
        out: dict[int, int] = {}
        finished = []
        running = SeqStatus.RUNNING
        if self.solo_failures:  # the engine ran a step: not broken
            self.solo_failures = 0
        for s, token in zip(scheduled, tokens):
            seq = s.seq
            if seq.status is not running or not s.sample:
                continue
            out[seq.seq_id] = token
            at = s.start + s.num_tokens + step  # the sampled token's index in token_ids
            seq.token_ids[at] = token
            seq.output_ids[at - seq.num_prompt] = token
            self.blocks.commit(seq, launched=True)
            reason = self.stop_reason(seq, token, at)
            if reason is not None:
                del seq.token_ids[at + 1:]
                del seq.output_ids[at + 1 - seq.num_prompt:]
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(Finished(seq, reason))
        return out, finished
