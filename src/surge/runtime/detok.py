"""Incremental detokenization with stop strings: what text a stream may show so far.

The output's text is decoded from all its tokens each time (byte-level BPE can
split a character over tokens, so text is only final once decoded whole); the
part shown holds back a trailing incomplete character and any suffix that could
still become a stop string. A stop string cuts the text exactly before it.
Streamed deltas and the non-streamed answer come from this one object, so their
texts are equal by construction.
"""

from __future__ import annotations


class TextState:
    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode = decode  # list[int] -> str
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # shown so far
        self.stopped = False

    def _holdback(self, text: str) -> int:
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def add(self, token: int, final: bool = False) -> str:
        """Add a token; return the new text to show (a stop string sets `stopped`)."""
        self.ids.append(token)
        full = self.decode(self.ids)
        cut = None
        if self.stop:
            # search only where a new match can start: after the shown text, less a stop string's length
            lo = max(0, len(self.text) - max(len(s) for s in self.stop))
            hits = [i for s in self.stop if (i := full.find(s, lo)) >= 0]
            if hits:
                cut = min(hits)
        if cut is not None:
            self.stopped = True
            visible = full[:cut]
        elif final:
            visible = full
        else:
            end = len(full)
            while end > 0 and full[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                end -= 1
            visible = full[:end]
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
