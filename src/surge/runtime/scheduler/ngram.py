"""Draft tokens for speculative decoding, looked up in the sequence itself (n-gram / prompt lookup).

An assistant's answer often repeats what it has read or written: a quoted passage of a RAG
context, a name, code being edited, JSON keys, a list's pattern. If the last n tokens occurred
before in the sequence, the tokens that followed that occurrence are a cheap guess at the next
ones; the model checks k guesses in one step (engines/decoder/runner.DecoderEngine.verify) and
the sequence keeps the guesses it agrees with, plus the model's own next token. The answer is
the one plain decoding gives, token for token: a guess only decides how many tokens one step
computes. vLLM calls this `ngram` speculation (prompt_lookup_min / prompt_lookup_max);
transformers' `generate(prompt_lookup_num_tokens=...)` is the same idea for one sequence.

Each sequence keeps an index of its n-grams (n in [n_min, n_max]) -> where the most recent
occurrence ended, grown by the tokens added since the last look: a lookup costs O(n_max) dict
probes, not a scan of the context.
"""

from __future__ import annotations


class NgramIndex:
    """The n-grams of one sequence's tokens, each mapped to the end of its latest occurrence."""

    __slots__ = ("n_min", "n_max", "ends", "upto")

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.ends: dict[tuple, int] = {}
        self.upto = 0  # n-grams ending before this index are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `tokens` (a sequence's whole text, prompt and output):
        the longest suffix of `tokens` (n_max down to n_min tokens) seen earlier, and what followed
        its latest earlier occurrence. When that occurrence overlaps the suffix (a repeating pattern)
        the continuation runs on into the draft itself, i.e. the pattern repeats. [] without a match.
        `tokens` may only grow between calls (the index is extended, never rebuilt)."""
        end = len(tokens)
        ends, n_min, n_max = self.ends, self.n_min, self.n_max
        # index the n-grams that end before the last token: an occurrence must have a continuation
        for e in range(max(self.upto, n_min), end):
            for n in range(n_min, min(n_max, e) + 1):
                ends[tuple(tokens[e - n:e])] = e
        self.upto = max(self.upto, end)
        if k <= 0:
            return []
        for n in range(min(n_max, end - 1), n_min - 1, -1):
            e = ends.get(tuple(tokens[end - n:]))
            if e is None:
                continue
            draft: list[int] = []
            for i in range(k):  # e < end: index e + i is in tokens or already in the draft
                j = e + i
                draft.append(tokens[j] if j < end else draft[j - end])
            return draft
        return []


class NgramProposer:
    """Drafts for the sequences of a step, `k` at most each, from their own tokens (NgramIndex)."""

    def __init__(self, k: int, n_min: int = 2, n_max: int = 4, max_batch: int | None = None):
        """`max_batch`: speculate only in steps of at most this many sequences (None: any)."""
        if k < 1:
            raise ValueError(f"speculative tokens must be >= 1, not {k}")
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, not {n_min}, {n_max}")
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.max_batch = max_batch if max_batch is not None else 1 << 30
        self._index: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, tokens: list[int], limit: int) -> list[int]:
        """At most min(k, limit) drafts for sequence `seq_id`, whose tokens are `tokens`."""
        index = self._index.get(seq_id)
        if index is None:
            index = self._index[seq_id] = NgramIndex(self.n_min, self.n_max)
        return index.propose(tokens, min(self.k, limit))

    def drafts(self, scheduled, sched) -> list[list[int]]:
        """The drafts of a step's decodes (StepLoop's speculator contract), cut to the KV blocks free."""
        if len(self._index) > 2 * len(sched.running) + 64:  # the indexes of sequences that ended
            self.keep([q.seq_id for q in sched.running])
        drafts = [self.propose(s.seq.seq_id, s.seq.token_ids, sched.draft_limit(s.seq, self.k)) for s in scheduled]
        return sched.make_room(scheduled, drafts) if any(drafts) else drafts

    def kept(self, scheduled, drafts) -> None:
        """After the step: nothing to do (the index grows from the tokens at the next lookup)."""

    def keep(self, seq_ids) -> None:
        """Drop the indexes of sequences not in `seq_ids` (finished or aborted)."""
        live = set(seq_ids)
        for sid in [s for s in self._index if s not in live]:
            del self._index[sid]
