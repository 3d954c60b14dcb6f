"""What a generation hands its caller: a stream's deltas and a whole answer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None = None  # per token: {"token", "logprob", "top": [(token, logprob)]}
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False
    # on the last delta: KServe statistics' stages in ns (queue: until admitted; compute_input: the
    # prefill, until the first token; compute_infer: the decode, first to last token)
    timings: dict | None = None
    # params.prompt_logprobs, on the first delta: the prompt's tokens from the second on, as `logprobs`
    prompt_logprobs: list[dict] | None = None
    # on the last delta, vLLM's stop_reason: the stop string or stop token id that ended the answer (None
    # for EOS, the length, or no stop yet)
    stop_reason: str | int | None = None
    # on the last delta: the prompt's tokens found in the prefix cache (all of them for an answer from the
    # generation cache), OpenAI's usage.prompt_tokens_details.cached_tokens
    cached_tokens: int = 0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] | None = None
    cached: bool = False
    timings: dict | None = None
    prompt_logprobs: list[dict] | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
