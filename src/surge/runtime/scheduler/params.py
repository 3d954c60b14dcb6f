"""Per-request sampling parameters (OpenAI's names), validated once at the edge."""

from __future__ import annotations

import numbers
import pickle
from dataclasses import dataclass, field, fields
from functools import cached_property

import numpy as np

from surge.errors import InvalidInput


SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
MAX_STOP_CHARS = 1024  # a stop string's length (markers are a few characters; 100 KB ones cost every token a scan)
_INTS = ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "priority")
_OPTIONAL = ("seed", "logprobs", "prompt_logprobs")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # (numpy's integers count)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends the answer before this many tokens
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # transformers' rule, over prompt and output
    presence_penalty: float = 0.0  # OpenAI's rules, over the output
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities per output token (0: only the chosen one's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's rule
    prompt_logprobs: int | None = None  # log-probabilities of the prompt's tokens (and this many top ones)
    guide: tuple[str, str] | None = None  # structured output: (kind, text), runtime/guided.py
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be sampled (empty: any)
    include_stop_str_in_output: bool = False  # vLLM's: a matched stop string stays in the text
    skip_special_tokens: bool = True  # the text leaves special tokens out
    # vLLM's bad_words as token sequences: a sequence's last token is never drawn where the output
    # already ends with the rest of it (a one-token word: never)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # max_tokens is the request's own, not a server default: past the context it is refused
    # (GenerateService.stream) where a default is cut at the context's end; the same generation either way
    own_max_tokens: bool = field(default=False, compare=False)
    # vLLM's request priority (lower first) under the scheduler's priority policy; not part of the answer
    priority: int = field(default=0, compare=False)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        self._check_types()
        if self.max_tokens < 1:
            raise InvalidInput("max_tokens must be at least 1", param="max_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidInput(f"min_tokens must be between 0 and max_tokens ({self.max_tokens})",
                               param="min_tokens")
        if self.min_tokens and self.guide is not None:
            raise InvalidInput("min_tokens cannot be combined with a structured output (a finished grammar "
                               "allows only the end of the answer)", param="min_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidInput("temperature must be between 0 and 100", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput("top_p must be in (0, 1]", param="top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidInput("min_p must be in [0, 1]", param="min_p")
        if self.top_k < -1:
            raise InvalidInput("top_k must be -1, 0 (off) or positive", param="top_k")
        if self.repetition_penalty <= 0:
            raise InvalidInput("repetition_penalty must be positive", param="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidInput(f"{name} must be between -2 and 2", param=name)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidInput("top_logprobs / logprobs must be between 0 and 20", param="logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidInput("prompt log-probabilities: at most 20 top ones", param="logprobs")
        if any(not s for s in self.stop):
            raise InvalidInput("stop strings must not be empty", param="stop")
        if len(self.stop) > 16:
            raise InvalidInput("at most 16 stop strings are allowed", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            # every token of every choice searches the text's end for each: a bound on the event loop's work
            raise InvalidInput(f"a stop string may be at most {MAX_STOP_CHARS} characters long", param="stop")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise InvalidInput("logit_bias values must be between -100 and 100", param="logit_bias")

    def _check_types(self) -> None:
        """Every route types its fields, but a value of the wrong type that got through would raise inside
        the engine's step (a float top_k as an index, a string seed), failing every sequence sharing it."""
        for name in _INTS:
            v = getattr(self, name)
            if not _is_int(v) and not (v is None and name in _OPTIONAL):
                raise InvalidInput(f"{name} must be an integer", param=name)
        for name in _FLOATS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise InvalidInput(f"{name} must be a number", param=name)
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise InvalidInput(f"{name} must be true or false", param=name)
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidInput("stop must be a string or a list of strings", param="stop")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if not all(_is_int(t) and t >= 0 for t in getattr(self, name)):
                raise InvalidInput(f"{name} must be non-negative token ids", param=name)

    @property
    def min_stops(self) -> bool:
        """min_tokens keeps some tokens from being sampled early (EOS unless ignored, stop token ids)."""
        return self.min_tokens > 0 and (not self.ignore_eos or bool(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        # Below SAMPLING_EPS the logits divided by the temperature overflow to inf (a softmax of NaNs) long
        # before the distribution stops being a point mass at the argmax: greedy, as vLLM decides it.
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def deterministic(self) -> bool:
        """Same prompt + params -> same answer: what the generation cache may store."""
        return self.greedy or self.seed is not None

    @property
    def penalized(self) -> bool:
        """The logits are changed before sampling (penalties, a logit bias, a guide's mask, min_tokens,
        allowed tokens, bad words): a greedy row cannot take the graph's argmax."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.guide is not None or self.min_stops or bool(self.allowed_token_ids)
                or bool(self.bad_words_ids))

    @property
    def bulk(self) -> int:
        """About how many items its request-sized fields hold (bad words, logit biases, token ids, stop strings,
        a guide's text in 64-character pieces): GenerateService.stream checks, keys and packs params of more
        than a thousand off the event loop (runtime/off_loop.py)."""
        return (len(self.bad_words_ids) + len(self.logit_bias) + len(self.allowed_token_ids)
                + len(self.stop_token_ids) + len(self.stop) + (len(self.guide[1]) // 64 if self.guide else 0))

    # What the sampler applies at every step, made once per request where its engine first needs it (cached on
    # the instance; the front ends never ask): a step's work is then the number of distinct word lengths, not
    # the number of words (100,000 bad words scanned as tuples cost every step of every sequence beside them
    # ~0.1 s: session 46), and no list of ids is rebuilt from tuples per step.
    @cached_property
    def bad_word_index(self) -> tuple[np.ndarray, tuple[tuple[int, dict[tuple[int, ...], list[int]]], ...]]:
        """vLLM's bad_words, indexed: (the last tokens of one-token words, never drawn, sorted; per length L of
        the longer words' prefixes, {the L tokens before a word's last: the last tokens they ban}). A word
        (..., a, b) bans b where the output ends with (..., a)."""
        always, longer = set(), {}
        for w in self.bad_words_ids:
            if len(w) == 1:
                always.add(w[0])
            else:
                longer.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), set()).add(w[-1])
        return (np.array(sorted(always), dtype=np.int64),
                tuple((n, {k: sorted(v) for k, v in t.items()}) for n, t in sorted(longer.items())))

    @cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids, values) arrays, made once (a step adds them)."""
        ids, bias = zip(*self.logit_bias) if self.logit_bias else ((), ())
        return np.array(ids, dtype=np.int64), np.array(bias, dtype=np.float64)

    @cached_property
    def allowed_ids_array(self) -> np.ndarray:
        """allowed_token_ids as an array, made once."""
        return np.array(self.allowed_token_ids, dtype=np.int64)

    def banned_after(self, out_ids: list[int]) -> list[int]:
        """The tokens the bad words ban after output `out_ids`, other than the one-token words' (bad_word_index)."""
        hit: list[int] = []
        for n, table in self.bad_word_index[1]:
            if len(out_ids) >= n:
                found = table.get(tuple(out_ids[len(out_ids) - n:]))
                if found:
                    hit.extend(found)
        return hit

    def pack(self) -> None:
        """Pickle these params now (on a thread, for large ones): sending them to the engine process then
        copies these bytes (__reduce_ex__) instead of pickling 100,000 bad words' tuples on the event loop."""
        object.__setattr__(self, "_packed", pickle.dumps(self, pickle.HIGHEST_PROTOCOL))

    def __reduce_ex__(self, protocol):
        packed = self.__dict__.get("_packed")
        if packed is None:
            return super().__reduce_ex__(protocol)
        return pickle.loads, (packed,)

    def key(self) -> tuple:
        # the fields themselves (immutable), not asdict's deep copy: 100,000 bad words took it 0.6 s
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.pop("extra")
        d.pop("own_max_tokens")
        d.pop("priority")
        if self.greedy:  # these do not change a greedy answer
            for k in ("temperature", "top_k", "top_p", "min_p", "seed"):
                d.pop(k)
        return tuple(sorted(d.items()))
