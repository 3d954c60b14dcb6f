"""One Anthropic message's content blocks and its stream (server/http/anthropic_messages.py).

The answer's blocks (server/http/answer_blocks.py) are the content blocks: the thinking a `thinking`
block (no signature: surge signs nothing), a text run a `text` block, each tool call a `tool_use` block
whose `input` is the call's arguments as an object. A stream is Anthropic's events, each with its
`event:` line: `message_start`, then per block `content_block_start`, its deltas (`thinking_delta`,
`text_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` (stop reason, output
tokens) and `message_stop`. A whole answer is built by the same class, so both have the same blocks.

Stop reasons: `max_tokens` (the length, whatever was written: Anthropic's whenever the limit was hit),
`tool_use` (the answer called a tool), `stop_sequence` (a stop string; which one in `stop_sequence`),
`end_turn` (EOS). A forced call (tool_choice any or tool) cut by max_tokens is dropped (answer_blocks.py):
the complete calls before it stay tool_use blocks.
"""

from __future__ import annotations

import json

import orjson

from surge.server.errors import anthropic_type
from surge.server.http.answer_blocks import AnswerBlocks
from surge.server.http.reasoning import REASONING


def stop(finish: str | None, stop_reason, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageEvents:
    """`base`: the message object without content, stop reason and output tokens. `forced`: tool_choice any
    or tool (AnswerBlocks')."""

    def __init__(self, base: dict, reasoning: str, parse_calls: str | None, forced: bool = False):
        self.base = base
        self.blocks = AnswerBlocks(reasoning, parse_calls, forced)
        self.content: list[dict] = []
        self.called = False
        self.message: dict | None = None

    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    def start(self) -> list[bytes]:
        return [self._event("message_start", message={**self.base, "content": [], "stop_reason": None,
                                                      "stop_sequence": None}),
                self._event("ping")]

    def _render(self, ops: list[tuple]) -> list[bytes]:
        out: list[bytes] = []
        for op in ops:
            index = len(self.content) - 1
            if op[0] == "open":
                block = {"type": "thinking", "thinking": "", "signature": ""} if op[1] == REASONING \
                    else {"type": "text", "text": ""}
                self.content.append(block)
                out.append(self._event("content_block_start", index=index + 1, content_block=dict(block)))
            elif op[0] == "piece":
                block = self.content[index]
                if not op[1]:
                    continue  # log-probabilities alone: Anthropic's blocks have no place for them
                if block["type"] == "thinking":
                    block["thinking"] += op[1]
                    out.append(self._event("content_block_delta", index=index,
                                           delta={"type": "thinking_delta", "thinking": op[1]}))
                else:
                    block["text"] += op[1]
                    out.append(self._event("content_block_delta", index=index,
                                           delta={"type": "text_delta", "text": op[1]}))
            elif op[0] == "close":
                out.append(self._event("content_block_stop", index=index))
            else:
                call = op[1]
                block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                         "name": call["function"]["name"], "input": _input(call["function"]["arguments"])}
                self.content.append(block)
                self.called = True
                out += [self._event("content_block_start", index=index + 1, content_block={**block, "input": {}}),
                        self._event("content_block_delta", index=index + 1,
                                    delta={"type": "input_json_delta",
                                           "partial_json": json.dumps(block["input"], ensure_ascii=False)}),
                        self._event("content_block_stop", index=index + 1)]
        return out

    def delta(self, d) -> list[bytes]:
        """`d`: a Delta of the stream (or a whole GenerationResult)."""
        return self._render(self.blocks.feed(d.text))

    def finish(self, d) -> list[bytes]:
        """`d`: the last Delta (or the GenerationResult). The prompt's tokens found in the prefix cache are
        `cache_read_input_tokens` and, as Anthropic counts them, not `input_tokens`."""
        out = self._render(self.blocks.finish())
        reason, sequence = stop(d.finish_reason, d.stop_reason, self.called)
        cached = d.cached_tokens
        usage = {"input_tokens": self.base["usage"]["input_tokens"] - cached, "output_tokens": d.completion_tokens,
                 "cache_read_input_tokens": cached}
        self.message = {**self.base, "content": self.content, "stop_reason": reason, "stop_sequence": sequence,
                        "usage": {**self.base["usage"], **usage}}
        return out + [self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                  usage=usage),
                      self._event("message_stop")]

    def failed(self, exc) -> list[bytes]:
        """`exc`: the SurgeError that ended the stream, as Anthropic's error event."""
        return [self._event("error", error={"type": anthropic_type(exc.http_status), "message": exc.message})]
