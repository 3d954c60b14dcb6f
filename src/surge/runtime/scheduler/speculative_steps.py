"""The scheduler's side of speculative decoding: drafts checked in one step (runtime/scheduler/ngram.py,
draft_model.py): how many drafts a sequence may have checked, room for them in the KV cache, and
what the verification step keeps.

A mixin of Scheduler, apart from scheduler.py because only speculative steps use it. Needs the
Scheduler's `config`, `blocks`, `running`, `stop_reason` and `_finish`.
"""

from __future__ import annotations

from surge.runtime.scheduler.sequence import SeqStatus, Sequence
from surge.runtime.scheduler.step import Finished, ScheduledSeq


class SpeculativeSteps:
    def draft_limit(self, seq: Sequence, k: int) -> int:
        """How many draft tokens `seq` may have checked in its next decode step: a step that accepts d
        drafts gives d + 1 tokens, which must stay within max_tokens and max_model_len."""
        left = min(seq.params.max_tokens - len(seq.output_ids), self.config.max_model_len - seq.num_tokens)
        return max(0, min(k, left - 1))

    def make_room(self, scheduled: list[ScheduledSeq], drafts: list[list[int]]) -> list[list[int]]:
        """The drafts whose positions get KV blocks: a sequence's drafts are cut to the blocks that are
        free (a draft never preempts anyone; schedule() already gave each decode its own position)."""
        out = []
        for s, d in zip(scheduled, drafts):
            while d and not self.blocks.ensure(s.seq, s.start + s.num_tokens + len(d)):
                d = d[:-1]
            out.append(d)
        return out

    def accept(self, scheduled: list[ScheduledSeq], drafts: list[list[int]],
               model: list[list[int]]) -> list[tuple[dict[int, int], list[Finished]]]:
        """A verification step's outcome: `model[i][j]` is the model's token (its argmax, or the row's
        draw for a sampled sequence) after scheduled[i]'s input and its first j drafts. A sequence keeps
        its drafts up to the first the model disagrees with, then the model's token there (all drafts
        kept: the token after the last one): 1 to d + 1 new tokens, the ones plain decoding gives.
        -> per new-token index j, as update() returns for a step: ({seq_id: its j-th new token}, the
        sequences finished at it). A stop (a stop token, EOS, max_tokens) ends the sequence there; its
        later tokens are dropped."""
        out: list[tuple[dict[int, int], list[Finished]]] = []
        running = SeqStatus.RUNNING
        for s, d, g in zip(scheduled, drafts, model):
            seq = s.seq
            if seq.status is not running:
                continue  # aborted while the step ran
            n = 0
            while n < len(d) and g[n] == d[n]:
                n += 1
            while len(out) <= n:
                out.append(({}, []))
            reason = None
            for j, token in enumerate(g[:n + 1]):
                seq.append(token)
                out[j][0][seq.seq_id] = token
                reason = self.stop_reason(seq, token)
                if reason is not None:
                    break
            # the K/V of every position before the newest token are computed (its input and kept drafts)
            seq.num_computed = seq.num_tokens - 1
            self.blocks.commit(seq)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                out[j][1].append(Finished(seq, reason))
        while out and not out[-1][0]:
            out.pop()
        return out
