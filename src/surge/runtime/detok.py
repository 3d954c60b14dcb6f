"""Incremental detokenization with stop strings: what text a stream may show so far.

Byte-level BPE can split a character over tokens, so a token's text is only
known in context. Decoding all of a stream's tokens for each new one costs
O(length) a token (at 64 streams of 128 tokens it was most of the event loop's
work: benchmarks/generate_host.py --text, docs/benchmarks/generate.md), so the
text is decoded from a short window instead, as TGI and vLLM do: the tokens
since the last point where the text ended in whole characters, decoded once
without and once with the new ones; the difference is the new text. Both
decodes start at the same token, so a decoder that treats a window's first
token specially (a SentencePiece leading space) does so in both. A window whose
longer decode does not extend its shorter one falls back to decoding
everything.

The part shown holds back a trailing incomplete character and any suffix that
could still become a stop string. A stop string cuts the text exactly before
it. Streamed deltas and the non-streamed answer come from this one object, so
their texts are equal by construction.
"""

from __future__ import annotations

_BAD = "\ufffd"


class TextState:
    def __init__(self, decode, stop: tuple[str, ...] = (), min_tokens: int = 0, keep_stop: bool = False):
        self.decode = decode  # list[int] -> str
        self.stop = stop
        self.min_tokens = min_tokens  # no stop string ends the text before this many tokens (vLLM's rule)
        self.keep_stop = keep_stop  # the matched stop string stays in the text (include_stop_str_in_output)
        self._stop_len = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.text = ""  # shown so far
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        # the text of ids[:_read] is _done; ids[_prefix:_read] decode to _window (the context that
        # the next tokens are decoded with)
        self._done = ""
        self._prefix = 0
        self._read = 0
        self._window = ""
        # the length of the text (less a trailing incomplete character) that stop strings were looked
        # for in: a new match needs some text after it (vLLM's rule: one written before min_tokens never counts)
        self._searched = 0

    def _holdback(self, text: str) -> int:
        """The longest end of `text` that begins a stop string (held back: the next tokens may complete it).
        Only lengths k whose stop string's k-th character is the text's last are tried (str.rfind finds
        them), not every k: per token that was each stop string's length in slices of it, the event loop's
        work on every token of every choice (session 46)."""
        if not text:
            return 0
        hold, last = 0, text[-1]
        for s in self.stop:
            k = s.rfind(last, 0, min(len(s) - 1, len(text))) + 1
            while k > hold:
                if text.endswith(s[:k]):
                    hold = k
                    break
                k = s.rfind(last, 0, k - 1) + 1
        return hold

    def _full(self) -> str:
        """The text of all tokens so far (what decode(ids) gives)."""
        ids = self.ids
        new = self.decode(ids[self._prefix:])
        w = self._window
        if not new.startswith(w):  # not a decoder that extends its text token by token
            full = self.decode(ids)
            self._done, self._prefix, self._read, self._window = "", 0, 0, ""
            return full
        tail = new[len(w):]
        full = self._done + tail
        if tail and not tail.endswith(_BAD):
            # whole characters up to here: the next window starts after the last one (not after a
            # token that added no text: a SentencePiece "▁" shows its space only with the next token)
            self._done = full
            self._window = self.decode(ids[self._read:])
            self._prefix, self._read = self._read, len(ids)
        return full

    def add(self, token: int, final: bool = False) -> str:
        """Add a token; return the new text to show (a stop string sets `stopped`)."""
        self.ids.append(token)
        if self.stopped:  # the text ended at its stop string
            return ""
        full = self._full()
        cut = None
        if self.stop and len(self.ids) >= self.min_tokens:
            # search only where a match with new text can start: the text searched before, less a stop
            # string's length (vLLM's window)
            lo = max(0, min(self._searched, len(full)) - self._stop_len + 1)
            hits = [(i, len(s), s) for s in self.stop if (i := full.find(s, lo)) >= 0]
            if hits:
                at, n, self.matched = min(hits)
                cut = at + n if self.keep_stop else at
        self._searched = len(full.rstrip(_BAD))
        if cut is not None:
            self.stopped = True
            visible = full[:cut]
        elif final:
            visible = full
        else:
            end = len(full)
            while end > 0 and full[end - 1] == _BAD:  # an incomplete UTF-8 sequence
                end -= 1
            visible = full[:end]
            if self.stop:
                visible = visible[:len(visible) - self._holdback(visible)]
        if not visible.startswith(self.text):
            # a later token changed earlier text (rare for byte-level BPE): keep what was shown
            return ""
        delta = visible[len(self.text):]
        self.text = visible
        return delta

    def flush(self) -> str:
        """At the end: whatever was held back (no stop string matched)."""
        if self.stopped:
            return ""
        full = self.decode(self.ids) if self.ids else ""
        if not full.startswith(self.text):
            return ""
        delta = full[len(self.text):]
        self.text = full
        return delta
