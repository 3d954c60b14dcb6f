"""Structured outputs ("guided decoding"): a request's JSON schema, regular expression, list of choices
or grammar becomes a mask of the tokens allowed at each step, so the answer always matches it.

llguidance (the grammar engine vLLM, SGLang and llama.cpp use) compiles the constraint and keeps one
matcher per sequence; the sampler (engines/decoder/sampler.py) asks it for the step's mask, sets the
other logits to -inf before greedy or sampled selection, and hands it the chosen token. A guided
sequence needs the host every step, so it takes the engine's synchronous path (as penalties do).

A guide travels in `SamplingParams.guide` as (kind, text): hashable, so the generation cache keys on
it. Kinds: "json" (a JSON schema as JSON text), "regex", "choice" (a JSON list of strings), "grammar"
(Lark or GBNF, llguidance's syntax); and "reasoned" (`after_reasoning`: one of those, from the end of a
reasoning model's thinking on).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from functools import lru_cache

import numpy as np

from surge import json_depth
from surge.errors import InvalidInput

KINDS = ("json", "regex", "choice", "grammar")
CACHED_CHARS = 64 * 1024  # the largest guide text whose compiled grammar a process keeps (Guides._compiled)
LARGE_KEPT = 4  # of larger ones, the last this many
# Guides whose built matcher a process keeps to copy for their sequences (Guides.matcher): a matcher holds its
# lexer's states, up to llguidance's limits
MATCHERS_KEPT = 32
# The most text a guide may force at once (llguidance's fast-forward bytes): its masks cost every step in
# proportion to it (~0.15 us a byte, per sequence), so that one 250 KB choice, JSON `const` or regex
# `a{500}{500}` cost each of a request's sequences 40-150 ms of every engine step, every stream waiting.
MAX_FORCED_BYTES = 8192
FORCED = (f"it is past the structured-output limits: it forces a text of more than {MAX_FORCED_BYTES:,} bytes at "
          "once (its masks cost every step in proportion to it); write long fixed text into the prompt instead")
ANY_OBJECT = json.dumps({"type": "object"})
# JSON written as json.dumps writes it (", " and ": ", no other whitespace), the form models mostly saw:
# with whitespace left free a weak model can fill max_tokens with newlines, and compact separators
# push a model that learned spaced JSON (hermes tool calls) off its text. A schema's own "x-guidance"
# options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def guide_for(kind: str, value, param: str) -> tuple[str, str]:
    """(kind, text) of a request's constraint; `value` as the request gave it (a schema may be an object,
    choices a list). Shape errors are InvalidInput naming `param`; whether the constraint compiles is
    `check`'s."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json_depth.loads(value)  # bounded: the json.dumps below recurses
            except ValueError as exc:
                raise InvalidInput(f"the JSON schema is not valid JSON ({exc})", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidInput("a JSON schema must be an object", param=param)
        return kind, json.dumps(value)  # in its own order: properties are written in the order given
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidInput("choices must be a non-empty list of non-empty strings", param=param)
        return kind, json.dumps(value)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise InvalidInput(f"the {kind} must be a non-empty string", param=param)
        return kind, value
    raise InvalidInput(f"unknown constraint '{kind}' (one of {', '.join(KINDS)})", param=param)


def after_reasoning(guide: tuple[str, str], end_token: int) -> tuple[str, str]:
    """`guide` held only after the model writes its end-of-thinking token (`end_token`, e.g. `</think>`),
    as vLLM applies a structured output with a reasoning parser once the reasoning ends: every token but that
    one is free until it comes (the thinking, which may also end the answer, as in vLLM), then the guide's
    grammar follows from the next token on. Kind "reasoned", text [end_token, kind, text]."""
    return "reasoned", json.dumps([int(end_token), guide[0], guide[1]])


def _reasoned(text: str) -> str:
    """The grammar of an `after_reasoning` guide: llguidance's top-level grammar whose first grammar is the
    thinking (tokens up to the end token) and then a reference to the guide's own grammar."""
    end, kind, inner_text = json.loads(text)
    inner = grammar((kind, inner_text))
    try:
        top = json.loads(inner)
    except ValueError:
        top = None
    grammars = list(top["grammars"]) if isinstance(top, dict) and "grammars" in top else [{"lark_grammar": inner}]
    grammars[0] = {**grammars[0], "name": "surge_answer"}
    think = {"name": "surge_reasoning", "lark_grammar": f"start: <[^{end}]>* <[{end}]> @surge_answer\n"}
    return json.dumps({"grammars": [think, *grammars]})


def grammar(guide: tuple[str, str]) -> str:
    """llguidance's grammar of a guide (not yet checked)."""
    import llguidance

    kind, text = guide
    if kind == "reasoned":
        return _reasoned(text)
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.grammar_from("grammar", text)


class Guides:
    """One model's tokenizer as llguidance sees it, and its compiled guides (`tokenizer_json`: the
    tokenizer.json text; `vocab_size`: the logits' width; `eos_ids`: the tokens that end a sequence,
    the only ones a finished grammar allows)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids=None):
        import llguidance

        # None: only to check guides (a front end); matchers need the model's end-of-sequence tokens
        self.eos = [int(t) for t in eos_ids] if eos_ids else []
        self.vocab_size = vocab_size
        eos = None if not self.eos else self.eos if len(self.eos) > 1 else self.eos[0]
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self._cached = lru_cache(maxsize=256)(self._compile)
        self._large: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._executor = None
        self._prototypes: OrderedDict = OrderedDict()  # guide -> its never-advanced matcher (matcher())
        self.built = 0  # matchers built from a grammar (the others are copies)

    def _compiled(self, guide: tuple[str, str]) -> tuple[str | None, str | None]:
        """_compile's answer, kept for guides of at most CACHED_CHARS: 256 kept guides of 2 MB (a request's
        grammar may be that large) held a process's gigabyte (session 46); of larger ones only the last
        LARGE_KEPT (a request's guide is checked by its route, then again where its generation starts)."""
        if len(guide[1]) <= CACHED_CHARS:
            return self._cached(guide)
        with self._lock:  # the front end checks guides on its preparation threads (runtime/off_loop.py)
            found = self._large.get(guide)
        if found is None:
            found = self._compile(guide)
            with self._lock:
                self._large[guide] = found
                while len(self._large) > LARGE_KEPT:
                    self._large.popitem(last=False)
        return found

    def _compile(self, guide: tuple[str, str]) -> tuple[str | None, str | None]:
        """(grammar, None) or (None, why it is not valid)."""
        import llguidance

        try:
            g = grammar(guide)
        except Exception as exc:  # noqa: BLE001 - the request's text is all it builds from (GBNF conversion too)
            return None, str(exc) or type(exc).__name__
        message = llguidance.LLMatcher.validate_grammar(g, self.tokenizer)
        if message and not message.startswith("WARNING"):
            return None, message.strip()
        why = self._first_steps(g if guide[0] != "reasoned" else grammar(tuple(json.loads(guide[1])[1:])))
        if why is not None:
            return None, why
        return g, None

    def _first_steps(self, g: str) -> str | None:
        """None when the answer's first steps of grammar `g` work, else why not: no token of the vocabulary can
        begin an answer of it (and the empty answer does not match it), or llguidance's parser gives up within
        its first two tokens (its lexer or row limits). A grammar this tokenizer cannot write (JSON on a
        vocabulary without `{`) leaves llguidance an error, or a first mask whose tokens its parser then
        rejects: the answer would be cut at its first token and end as if it were complete. A grammar past the
        parser's limits (a regex `x a{1000}{1000}`, 20,000 choices) cost each sequence of the request ~1 s of
        the engine's step, every other stream waiting, before failing it (session 48): the front end pays it
        here, once, on its preparation thread, and refuses it. A reasoned guide is checked on its grammar after
        the thinking."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, g, log_level=0)
        if _forces_too_much(m):
            return FORCED
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if m.is_error():
            return _past_limits(m) if _too_complex(m) else CANNOT_START
        if m.is_accepting():
            return None
        # the first mask over-approximates here (`\{[a-z]+\}` without `{` lets every letter through): each
        # allowed token is tried, ~1 us each, stopping at the first one taken (at once, for a grammar it can write)
        first = next((t for t in np.flatnonzero(bits[: self.vocab_size]).tolist()
                      if t not in self.eos and m.validate_tokens([t]) == 1), None)
        if first is None:
            return CANNOT_START
        m.consume_token(first)
        if _forces_too_much(m):
            return FORCED
        m.compute_bitmask()
        return _past_limits(m) if m.is_error() and _too_complex(m) else None

    def literal(self, text: str) -> str:
        """`text` as a Lark literal that matches how the model writes it: a token llguidance counts as
        special (an added `<tool_call>`, say) only matches as that token (`<[id]>`), other text as a string."""
        ids = self.tokenizer.tokenize_str(text)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def check(self, guide: tuple[str, str], param: str) -> None:
        """InvalidInput (400, naming `param`) when the guide does not compile for this model."""
        _, error = self._compiled(guide)
        if error is not None:  # the field in the message too: KServe's errors have no param
            raise InvalidInput(f"{param}: the {guide[0]} constraint is not valid: {error}", param=param)

    def matcher(self, guide: tuple[str, str]) -> "Matcher":
        """A fresh matcher of the guide. Never raises for the guide itself (it runs in the engine's step
        loop, where an exception would fail every stream): one that does not compile, which the front
        end's check keeps from getting here, gives a matcher that allows only the end of the sequence (and
        rejects it: the sequence fails)."""
        import llguidance

        if not self.eos:
            raise ValueError("matchers need the model's end-of-sequence tokens")
        g, error = self._compiled(guide)
        if error is not None:
            return Matcher(None, self.vocab_size, self.eos, error)
        # A copy of the guide's one built matcher: llguidance's copies share the lexer's states (each its own
        # place in the answer), so a request's n choices, and later requests with the same guide, pay the
        # lexer's first build once, not once each in the engine's step where every stream waits (session 48:
        # `a{500}{500}`, ~0.3 s a build, n=16 held a neighbour's answer 5.5 s).
        with self._lock:  # matchers are built on the sampler's threads
            proto = self._prototypes.get(guide)
            if proto is None:
                proto = self._prototypes[guide] = llguidance.LLMatcher(self.tokenizer, g, log_level=0)
                self.built += 1
                large = [k for k in self._prototypes if len(k[1]) > CACHED_CHARS]  # as _compiled: few kept
                for k in large[: max(0, len(large) - LARGE_KEPT)]:
                    del self._prototypes[k]
                while len(self._prototypes) > MATCHERS_KEPT:
                    self._prototypes.popitem(last=False)
            else:
                self._prototypes.move_to_end(guide)
            m = proto.deep_copy()
        return Matcher(m, self.vocab_size, self.eos)

    def masks(self, matchers: list["Matcher"]) -> np.ndarray:
        """The next tokens' masks of several sequences ([rows, words] int32, Matcher.mask's layout),
        computed side by side on llguidance's threads (the GIL released)."""
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask_par

        words = (self.vocab_size + 31) // 32
        out = np.empty((len(matchers), words), dtype=np.int32)
        live = []
        for i, m in enumerate(matchers):
            m.bound()
            if m.error is not None:
                out[i] = m.mask()
            else:
                live.append((m._m, i))
        if len(live) == 1:
            out[live[0][1]] = matchers[live[0][1]].mask()
        elif live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            fill_next_token_bitmask_par(self._executor, live, out)
        return out


CANNOT_START = ("no token of this model's vocabulary can start an answer that matches it (the tokenizer cannot "
                "write the characters the constraint begins with)")


def _forces_too_much(m) -> bool:
    """Whether the text a matcher's guide forces next is longer than MAX_FORCED_BYTES (False in an error state:
    the caller's check says why)."""
    return not m.is_error() and len(m.compute_ff_bytes()) > MAX_FORCED_BYTES


LIMIT_WORDS = ("too many", "max is", "fuel", "too complex", "toocomplex", "panic")  # a panic: an internal bound
# (a grammar of 30,000 rules: "assertion failed: grammar.symbols.len() < u16::MAX ..."), not the vocabulary


def _too_complex(m) -> bool:
    """Whether a matcher stopped at llguidance's parser limits ("lexer error: too many expressions constructed",
    "Current row has 20001 items; max is 2000", ...), not at what its grammar or the vocabulary allow."""
    text = ((m.get_error() or "").strip().splitlines() or [""])[0].lower()
    return any(w in text for w in LIMIT_WORDS)


def _past_limits(m) -> str:
    """A matcher's error as a request's message: its first line (llguidance appends its state and the whole
    grammar, which a client gave and does not need back)."""
    first = (m.get_error() or "").strip().splitlines()[:1]
    return ("it is past the structured-output parser's limits (" + (first[0] if first else "unknown error")
            + "): simplify it (fewer alternatives, smaller repetition counts)")


class Matcher:
    """One sequence's place in its guide (`matcher` None: the guide did not compile, `error` says why)."""

    def __init__(self, matcher, vocab_size: int, eos: list[int], error: str | None = None):
        self._m = matcher
        self._error = error
        self.consumed = 0  # tokens given to consume() (the sampler's rewind compares it with the output's)
        self.words = (vocab_size + 31) // 32
        self._eos_only = np.zeros(self.words, dtype=np.uint32)
        for t in eos:
            self._eos_only[t // 32] |= np.uint32(1 << (t % 32))
        self._eos_only = self._eos_only.view(np.int32)

    def mask(self) -> np.ndarray:
        """The next token's allowed set: int32 words, bit i of word w allows token 32 w + i. A matcher in
        an error state (the sampler only picks allowed tokens, so only a grammar too costly for the
        parser's limits gets there) allows the end-of-sequence tokens only, which it then rejects: the sampler
        fails the sequence (GuideRejected) rather than end an answer that breaks its format."""
        self.bound()
        if self.error is not None:
            return self._eos_only
        return np.frombuffer(self._m.compute_bitmask(), dtype=np.int32)[: self.words]

    def bound(self) -> None:
        """Put the matcher in an error state when its guide now forces more than MAX_FORCED_BYTES (an
        alternative the answer took): its mask then allows only the end, which it rejects, and the sampler
        fails its sequence alone (GuideRejected), before that text's masks cost every step (session 48)."""
        if self._m is not None and _forces_too_much(self._m):
            self._m, self._error = None, FORCED

    def consume(self, token: int) -> bool:
        """Whether the guide accepts `token` (False: the matcher is in an error state from now on)."""
        self.consumed += 1
        return self._m is not None and self._m.consume_token(int(token))

    @property
    def error(self) -> str | None:
        if self._m is None:
            return self._error
        return self._m.get_error() if self._m.is_error() else None


def allowed(masks: np.ndarray, vocab_size: int, device):
    """Bool [rows, vocab_size] of `Guides.masks` words, on `device`."""
    import torch

    words = torch.from_numpy(np.ascontiguousarray(masks)).to(device)
    bits = (words[:, :, None] >> torch.arange(32, device=device, dtype=torch.int32)) & 1
    return bits.reshape(len(masks), -1)[:, :vocab_size].bool()
