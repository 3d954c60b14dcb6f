"""One generation request as the scheduler sees it: tokens, progress, KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from surge.runtime.scheduler.params import SamplingParams

PLACEHOLDER = -1  # a token sampled on the device, not read back yet


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks computed
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt: int = 0  # of those, found in the prefix cache at admission
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    retries: int = 0  # times set apart to run alone after a step of it raised (Scheduler.isolate)
    scheduled_at: float = 0.0  # time.monotonic() of the first admission (KServe "queue" time ends there)
    # overlapped steps (runtime/scheduler/overlap.py): the token of a launched step is a placeholder
    # until its step is read back; a sequence whose last token is launched stops being scheduled
    draining: bool = False
    fast: bool = False  # greedy, no penalties, no logprobs: its tokens can stay on the device
    speculable: bool = False  # no penalties, guide or logprobs: drafts can be checked (greedy or sampled)
    # params.prompt_logprobs: the prompt positions scored so far (position p scores token p + 1) and
    # their (token, logprob, top, rank) not yet handed out (with the first sampled token's SampleOut)
    prompt_scored: int = 0
    prompt_lps: list | None = None
    # LoRA: the engine slot of the sequence's adapter, given at admission (0: the base model), and the
    # adapter's id (a digest of its files), which keeps its KV blocks apart from other adapters' in the
    # prefix cache (0: the base model's)
    adapter: int = 0
    adapter_uid: int = 0

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        p = self.params
        self.speculable = not p.penalized and p.logprobs is None and p.prompt_logprobs is None
        self.fast = p.greedy and self.speculable

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Prompt positions are still to be scored (its prefix must be computed, not taken from the cache)."""
        return self.params.prompt_logprobs is not None and self.prompt_scored < self.num_prompt - 1

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_ids.append(token)
