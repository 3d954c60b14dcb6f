"""The request flags and additional outputs of Triton's vLLM backend (its docs/additional_outputs.md), shared
by the generate extension (server/http/kserve_generate.py: JSON fields) and /infer (server/
kserve_generate_infer.py: tensors), so that both answer alike.

  exclude_input_in_output    the prompt before the completion or not (defaults differ: see each caller);
                             a stream never repeats the prompt, and asking it to is refused, as the backend does
  return_finish_reason       finish_reason       the reason the answer ended (null before the last response)
  return_cumulative_logprob  cumulative_logprob  the sum of the chosen tokens' log-probabilities so far
  return_logprobs            logprobs            JSON text: per token of this response {token id: {"logprob",
                                                 "rank", "decoded_token"}}, the chosen token and the top
                                                 `logprobs` (the sampling parameter; 0 when unset)
  return_num_input_tokens    num_input_tokens    the prompt's tokens
  return_num_output_tokens   num_output_tokens   the tokens of this response (a stream's: its delta's)

The log-probabilities are the raw model's (before penalties and temperature), vLLM's default. Where the
backend answers "null" for return_logprobs without a `logprobs` sampling parameter, surge gives the chosen
tokens' (as logprobs=0): the flag alone says the client wants them.

`n`: the backend hands it to vLLM and answers a text_output of n elements; surge's KServe routes answer one
generation, so n other than 1 is refused rather than silently answered with one.
"""

from __future__ import annotations

import json

from surge.errors import InvalidInput

RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                "return_num_output_tokens")
FLAGS = ("exclude_input_in_output", *RETURN_FLAGS)
# each additional output and the flag that asks for it
OUTPUT_FLAG = {"finish_reason": "return_finish_reason", "cumulative_logprob": "return_cumulative_logprob",
               "logprobs": "return_logprobs", "num_input_tokens": "return_num_input_tokens",
               "num_output_tokens": "return_num_output_tokens"}
STREAM_PROMPT_ERROR = ("exclude_input_in_output false is not allowed when streaming: a stream's responses are "
                       "the generated text only (as Triton's vLLM backend)")


def check_n(n) -> None:
    if n is not None and (isinstance(n, bool) or n != 1):
        raise InvalidInput(f"'n' must be 1 here: the KServe generate routes answer one generation a request "
                           f"(got {n!r}; /v1/completions takes n)", param="n")


def logprobs_wanted(flags: dict, logprobs: int | None) -> int | None:
    """The sampling parameter `logprobs` to run with: the request's, or 0 (the chosen token's only) when an
    additional output needs log-probabilities; None when nothing does."""
    if logprobs is not None:
        return logprobs
    if flags.get("return_cumulative_logprob") or flags.get("return_logprobs"):
        return 0
    return None


def vllm_entry(lp: dict) -> dict:
    """One token's vLLM logprobs (its backend's, and vLLM's `prompt_logprobs` entries): the chosen token, then
    the top ones (ranks by their order)."""
    out = {str(lp["token_id"]): {"logprob": lp["logprob"], "rank": lp.get("rank"), "decoded_token": lp["token"]}}
    for rank, (text, value, token) in enumerate(lp.get("top") or [], start=1):
        if str(token) not in out:
            out[str(token)] = {"logprob": value, "rank": rank, "decoded_token": text}
    return out


class Extras:
    """One request's additional outputs, response after response (a stream's cumulative log-probability runs
    on across them)."""

    def __init__(self, flags: dict):
        self.flags = flags
        self.cumulative = 0.0

    def values(self, logprobs: list[dict] | None, token_count: int, finish: str | None, prompt_tokens: int) -> dict:
        """{output name: value} of the flags set, for a response carrying `token_count` new tokens and their
        `logprobs` (surge's dicts, runtime/generate_service.py)."""
        f, out = self.flags, {}
        lps = logprobs or []
        self.cumulative += sum(lp["logprob"] for lp in lps)
        if f.get("return_finish_reason"):
            out["finish_reason"] = finish
        if f.get("return_cumulative_logprob"):
            out["cumulative_logprob"] = self.cumulative
        if f.get("return_logprobs"):
            out["logprobs"] = json.dumps([vllm_entry(lp) for lp in lps])
        if f.get("return_num_input_tokens"):
            out["num_input_tokens"] = prompt_tokens
        if f.get("return_num_output_tokens"):
            out["num_output_tokens"] = token_count
        return out
