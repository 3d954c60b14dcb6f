"""A generated answer cut into the blocks the item-based APIs show: the Responses API's output items
(server/http/responses_events.py) and Anthropic's content blocks (server/http/anthropic_events.py).

The text is read in order by the model's reasoning parser (server/http/reasoning.py: the thinking is a
"reasoning" block), then by its tool-call parser (server/http/tool_calls.py: a text run is a "text"
block, each call a "call"). Blocks never nest or interleave: a block is opened, filled by
pieces and closed before the next one opens. Blank text next to calls is no block (a newline between
two calls, say); an answer of blank text only is a text block of it, and an empty answer one empty
text block. A forced answer (tool_choice required or named: calls only) cut by max_tokens drops the call
it was writing, as chat does (tool_calls.parse's `forced`): its partial JSON is no text block. Log-probabilities go with the text they wrote (the thinking's are dropped: neither API has
a place for them).

`feed` and `finish` return operations, which each API renders as its events:
("open", kind) / ("piece", text, logprobs) / ("close",) / ("call", call) with `call` as
tool_calls.parse writes it (chat's {"id", "type", "function": {"name", "arguments"}}).
"""

from __future__ import annotations

from surge.server.http.reasoning import REASONING, ReasoningStream
from surge.server.http.tool_calls import stream

TEXT = "text"


class AnswerBlocks:
    def __init__(self, reasoning: str = "none", parse_calls: str | None = None, forced: bool = False):
        """`parse_calls`: the tool-call parser's name (None: calls are not read). `forced`: the answer is
        held to calls (tool_choice required or named): text still held as a call's start at the end is dropped."""
        self.forced = forced
        self.thinking = ReasoningStream(reasoning) if reasoning != "none" else None
        self.calls = stream(parse_calls)
        self.open: str | None = None  # the kind of the open block
        self.blocks = 0  # blocks and calls so far
        self.answered = False  # a text block or call so far
        self.thought = ""  # all of the reasoning
        self.held = ""  # blank answer text, a block only if text follows

    def _piece(self, kind: str, text: str, logprobs=None) -> list[tuple]:
        out: list[tuple] = []
        if self.open != kind:
            out += self._close()
            out.append(("open", kind))
            self.open, self.blocks = kind, self.blocks + 1
            self.answered |= kind == TEXT
        if text or logprobs:
            out.append(("piece", text, logprobs))
        if kind == REASONING:
            self.thought += text
        return out

    def _close(self) -> list[tuple]:
        if self.open is None:
            return []
        self.open = None
        return [("close",)]

    def _answer(self, text: str, logprobs) -> list[tuple]:
        if self.calls is None:
            return self._piece(TEXT, text, logprobs) if text or logprobs else []
        out: list[tuple] = []
        pieces = self.calls.feed(text)
        if logprobs and not any(t for t, _ in pieces):  # a token's scores go out with text, or alone
            pieces.insert(0, ("", None))
        for k, (piece, call) in enumerate(pieces):
            lps = logprobs if k == 0 else None
            if call is not None:
                self.held = ""  # blank text between calls is no block
                out += self._close() + [("call", call[1])]
                self.blocks, self.answered = self.blocks + 1, True
            elif self.open != TEXT and not (self.held + piece).strip() and not lps:
                self.held += piece
            elif piece or lps:
                piece, self.held = self.held + piece, ""
                out += self._piece(TEXT, piece, lps)
        return out

    def feed(self, text: str, logprobs=None) -> list[tuple]:
        if self.thinking is None:
            return self._answer(text, logprobs)
        out: list[tuple] = []
        for field, piece in self.thinking.feed(text):
            if field == REASONING:
                out += self._piece(REASONING, piece)
            else:
                out += self._answer(piece, logprobs)
                logprobs = None
        if logprobs and self.thinking.answering:  # held text of the answer: its scores go out now
            out += self._answer("", logprobs)
        return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        if self.thinking is not None:
            for _, piece in self.thinking.finish():
                out += self._piece(REASONING, piece)
        if self.calls is not None:
            tail, self.held = self.held + self.calls.finish(), ""
            tail = "" if self.forced else tail
            if tail and (self.open == TEXT or tail.strip() or not self.answered):
                out += self._piece(TEXT, tail)
        if not self.blocks:
            out += self._piece(TEXT, "")  # an empty answer is still a text block
        return out + self._close()
