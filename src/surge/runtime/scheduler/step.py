"""What one scheduler step is made of: each sequence's share of the step (ScheduledSeq), and the
sequences it ended (Finished).

Apart from scheduler.py because the scheduler's step-resolving mixins (launched_steps.py,
speculative_steps.py) and the engines build and read them too.
"""

from __future__ import annotations

from dataclasses import dataclass

from surge.runtime.scheduler.sequence import Sequence


@dataclass(slots=True)  # built for every sequence every step
class ScheduledSeq:
    seq: Sequence
    start: int  # first token computed this step
    num_tokens: int
    sample: bool  # the chunk reaches the sequence's end: a new token is sampled


@dataclass
class Finished:
    seq: Sequence
    reason: str
