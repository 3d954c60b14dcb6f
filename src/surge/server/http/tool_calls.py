"""Tool calls in a chat model's output: the Hermes format (Qwen2.5, Hermes, many fine-tunes), which
`GenerationConfig.tool_call_parser: hermes` turns on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each such block becomes an OpenAI tool call (`arguments` as a JSON string) and leaves the message's
content; a block whose body is not a JSON object with a string `name` stays content, as vLLM keeps it.
`ToolCallStream` does the same over a stream: content is passed on as it comes, except a tail that may be
the start of `<tool_call>`, which is held until it is known not to be one; a call goes out whole once its
closing tag arrives.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("none", "hermes")


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer; content None when only calls were written."""
    stream = ToolCallStream()
    content = "".join(piece for piece, _ in stream.feed(text) if piece) + stream.finish()
    calls = stream.emitted
    if calls and not content.strip():
        return None, calls
    return content, calls


def _held_prefix(text: str) -> int:
    """Length of the longest tail of `text` that begins `<tool_call>` (held back while streaming)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Feed text as it is generated; `feed` returns [(content piece, None) | (None, (index, call))] in
    order, `index` counting the answer's calls from 0 (a streamed tool_calls delta's index)."""

    def __init__(self):
        self._buf = ""
        self._inside = False
        self.emitted: list[dict] = []

    def feed(self, text: str) -> list[tuple[str | None, tuple[int, dict] | None]]:
        self._buf += text
        out: list = []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
                self._inside = False
                call = _call(body.strip())
                if call is None:  # not a call: the block stays text, as written
                    out.append((OPEN + body + CLOSE, None))
                else:
                    out.append((None, (len(self.emitted), call)))
                    self.emitted.append(call)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append((self._buf[:start], None))
                self._buf = self._buf[start + len(OPEN):]
                self._inside = True
                continue
            keep = _held_prefix(self._buf)
            ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            if ready:
                out.append((ready, None))
            return out

    def finish(self) -> str:
        """What is held at the end: an unclosed block or a partial tag is content."""
        rest = (OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return rest
