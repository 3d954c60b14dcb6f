"""Drive the generation step loop as the service's engine thread does, with sequences arriving at given steps
(no torch here: the scheduler's own tests use it without a model)."""

from __future__ import annotations


def drive(loop, sched, seqs, arrivals, before_step=None, early: bool = False) -> dict[int, list[int]]:
    """Step `loop` until idle; seqs[i] is added at step arrivals[i] (arrivals ascending, as seqs are ordered);
    `before_step(step)` runs before each step; the block manager's invariants are checked after each.
    `early`: the sequences due at the next step arrive during this one instead, through the loop's
    `refresh` (as an engine loop reads its inbox again after draining its launches in flight).
    -> the tokens each sequence was handed, by seq_id, in order."""
    streamed = {s.seq_id: [] for s in seqs}
    step, added = 0, 0

    def add_due(upto: int) -> None:
        nonlocal added
        while added < len(seqs) and arrivals[added] <= upto:
            sched.add(seqs[added])
            added += 1

    while added < len(seqs) or loop.busy:
        add_due(step)
        if before_step is not None:
            before_step(step)
        for r in (loop.step(lambda: add_due(step + 1)) if early else loop.step()):
            for sid, token in r.tokens.items():
                streamed[sid].append(token)
            for f in r.finished:
                assert f.seq.finish_reason in ("stop", "length")
        sched.blocks.check()
        step += 1
    return streamed
