"""`llama3_json` (Llama 3.1 / 3.2 / 3.3 with JSON tool calls, as vLLM's parser of that name): an answer that
is a call is a JSON object, optionally after `<|python_tag|>` (a special token, so usually left out of
the text), and several calls are joined by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The arguments are under "parameters" (Llama 3.1's template writes that) or "arguments". An answer that
does not start (after whitespace and the tag) with `{` is content, and so is one whose first object is
not a call (an object with a string "name" and an object of arguments): a JSON answer to a question is
not taken for a call. What follows the last call, when it is not `;` and another call, is content.

Streaming: content flows as soon as the answer is known not to start with a call; text that may still
become one (leading whitespace, the tag, an object still open) is held; each call goes out whole once its
object closes. Where vLLM's whole-answer parser finds a call anywhere in the text, surge reads one only at
the start, as vLLM's stream does, so that a streamed answer always equals the whole one.
"""

from __future__ import annotations

from surge.server.http.tool_parsers.common import CallStream, JsonEnd, loads, name_and_args, skip_space

TAG = "<|python_tag|>"
ARGS_KEY = "parameters"  # what Llama 3.1's template writes, and the tool_choice grammar
KEYS = ("parameters", "arguments")
START, OBJECT, BETWEEN, PLAIN = "start", "object", "between", "plain"


class Llama3JsonStream(CallStream):
    def __init__(self):
        super().__init__()
        self._state = START
        self._buf = ""  # held text: since the start, or since the end of the last call
        self._obj = 0  # where the open object starts in _buf
        self._scanned = 0  # how far the open object was scanned
        self._scan = JsonEnd()

    def _plain(self, out: list) -> list:
        """Not (or no more) calls: the held text and all that follows is content."""
        if self._buf:
            out.append((self._buf, None))
        self._buf, self._state = "", PLAIN
        return out

    def feed(self, text: str) -> list[tuple[str | None, tuple[int, dict] | None]]:
        if self._state == PLAIN:
            return [(text, None)] if text else []
        self._buf += text
        out: list = []
        while True:
            if self._state == OBJECT:
                end = self._scan.scan(self._buf[self._scanned:])
                if end is None:
                    self._scanned = len(self._buf)
                    return out
                end += self._scanned
                call = name_and_args(loads(self._buf[self._obj:end]), KEYS)
                if call is None:
                    return self._plain(out)
                out.append(self._emit(*call))
                self._buf, self._state = self._buf[end:], BETWEEN
                continue
            at = skip_space(self._buf, 0)
            rest = self._buf[at:]
            if self._state == START:
                if TAG.startswith(rest):  # nothing yet, or a part of the tag
                    return out
                if rest.startswith(TAG):
                    at = skip_space(self._buf, at + len(TAG))
            else:  # BETWEEN calls: `;` and the next one, or the end
                if not rest:
                    return out
                if rest[0] != ";":
                    return self._plain(out)
                at = skip_space(self._buf, at + 1)
            if at == len(self._buf):
                return out
            if self._buf[at] != "{":
                return self._plain(out)
            self._obj = self._scanned = at
            self._scan, self._state = JsonEnd(), OBJECT

    def finish(self) -> str:
        """What is held at the end (whitespace, the tag, an unclosed object, a trailing `;`) is content."""
        rest, self._buf = self._buf, ""
        return rest


def grammar(many: bool, literal) -> str:
    repeat = ' ("; " body)*' if many else ""
    return f"start: body{repeat}\n"
