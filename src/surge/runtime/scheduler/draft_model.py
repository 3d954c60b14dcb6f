"""Draft tokens from a small model of the same tokenizer (speculative decoding with a draft model).

A 0.5B model that shares a 7B model's tokenizer guesses its next tokens well enough on ordinary text,
where n-gram lookup (ngram.py) finds nothing: each speculative step the draft model decodes k tokens
greedily and the target model checks them in one step (DecoderEngine.verify), as vLLM's draft-model
speculation does. The answer stays the target's own (greedy: its argmax; sampled: its draws).

The draft engine keeps its KV cache in blocks numbered as the target's (same block size, as many blocks):
a sequence's block table serves both, so the scheduler's allocation, preemption and prefix cache need
nothing more. What the draft has computed is tracked per sequence (`_done`) and caught up lazily with one
prefill chunk before the sequence's next drafts (the prompt at its first speculative step; the tokens a
plain step or a rejected draft left behind later). A draft's K/V that is stale or missing (a block shared
from the prefix cache, rows of another sequence's rejected drafts) can only make its guesses worse: the
target checks every one.
"""

from __future__ import annotations

from surge.runtime.scheduler.step import ScheduledSeq


class DraftModelProposer:
    """`engine`: the draft model's DecoderEngine (engines/decoder/runner.py), built with the target's
    num_blocks and block_size; `k` drafts a step at most; `max_batch` as NgramProposer's."""

    def __init__(self, engine, k: int, max_batch: int | None = None):
        if k < 1:
            raise ValueError(f"speculative tokens must be >= 1, not {k}")
        self.engine = engine
        self.k = k
        self.max_batch = max_batch if max_batch is not None else 1 << 30
        # seq_id -> (positions whose draft K/V are computed, the sequence's preemptions then)
        self._done: dict[int, tuple[int, int]] = {}

    def drafts(self, scheduled: list[ScheduledSeq], sched) -> list[list[int]]:
        """Up to k greedy tokens of the draft model after each decode's input (fewer where max_tokens, the
        context or the free KV blocks allow fewer), their blocks taken."""
        if len(self._done) > 2 * len(sched.running) + 64:
            live = {q.seq_id for q in sched.running}
            self._done = {sid: v for sid, v in self._done.items() if sid in live}
        room = sched.make_room(scheduled, [[0] * sched.draft_limit(s.seq, self.k) for s in scheduled])
        counts = [len(r) for r in room]
        if not any(counts):
            return [[] for _ in scheduled]
        rows = [s for s, n in zip(scheduled, counts) if n]
        self._catch_up(rows)
        got = self.engine.draft_tokens(rows, [n for n in counts if n])
        it = iter(got)
        return [next(it) if n else [] for n in counts]

    def _catch_up(self, rows: list[ScheduledSeq]) -> None:
        """One prefill chunk a sequence: the positions before its input the draft has not computed."""
        chunks = []
        for s in rows:
            seq = s.seq
            done, preempted = self._done.get(seq.seq_id, (0, seq.preemptions))
            if preempted != seq.preemptions:  # its blocks were given back: the draft's K/V went with them
                done = 0
            if done < s.start:
                chunks.append(ScheduledSeq(seq, done, s.start - done, False))
        if chunks:
            self.engine.step(chunks)

    def kept(self, scheduled: list[ScheduledSeq], drafts: list[list[int]]) -> None:
        """After the target's step: the draft computed the K/V of the input and of each draft but the last;
        those up to the first draft the target refused stand."""
        for s, d in zip(scheduled, drafts):
            seq = s.seq
            if not d:
                continue
            new = seq.num_tokens - 1 - s.start  # tokens the step added (kept drafts + 1)
            self._done[seq.seq_id] = (s.start + min(new, len(d)), seq.preemptions)
