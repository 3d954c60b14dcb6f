"""`hermes` (Qwen2.5, Hermes, many fine-tunes): each call a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose body is not a JSON object with a string `name` stays content, as vLLM keeps it. While
streaming, content goes out as it comes, except a tail that may be the start of `<tool_call>`, held until
it is known not to be one; a call goes out whole once its closing tag arrives. An unclosed block is content.
"""

from __future__ import annotations

from surge.server.http.tool_parsers.common import CallStream, held_prefix, loads

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGS_KEY = "arguments"  # what the tool_choice grammar writes


def _call(body: str) -> tuple[str, object] | None:
    obj = loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get("arguments", obj.get("parameters", {}))


class HermesStream(CallStream):
    def __init__(self):
        super().__init__()
        self._buf = ""
        self._inside = False

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
                # not a call: the block stays text, as written
                out.append((OPEN + body + CLOSE, None) if call is None else self._emit(*call))
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append((self._buf[:start], None))
                self._buf = self._buf[start + len(OPEN):]
                self._inside = True
                continue
            keep = held_prefix(self._buf, OPEN)
            ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            if ready:
                out.append((ready, None))
            return out

    def finish(self) -> str:
        """What is held at the end: an unclosed block or a partial tag is content."""
        rest = (OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return rest


def grammar(many: bool, literal) -> str:
    """The `start` rule of a forced tool choice over the `body` rule (one call's JSON)."""
    repeat = ' ("\\n" call)*' if many else ""
    return f'start: call{repeat}\ncall: {literal(OPEN)} "\\n" body "\\n" {literal(CLOSE)}\n'
