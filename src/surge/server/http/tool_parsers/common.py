"""What the tool-call parsers share: a call as chat's `tool_calls` writes it, call ids, the end of a JSON
object read as the text comes, and the held tail that may begin a tag."""

from __future__ import annotations

import json
import secrets
import string
import uuid

from surge import json_depth

_ALNUM = string.ascii_letters + string.digits


def hex_id() -> str:
    """OpenAI-style call id (hermes, llama3_json)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def alnum9_id() -> str:
    """Mistral's: 9 letters and digits (mistral-common refuses any other id in later turns; vLLM writes these)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def make_call(name: str, args, new_id, call_id: str | None = None) -> dict:
    return {"id": call_id or new_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def loads(text: str):
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return json_depth.loads(text)  # a model's output, nested deeper than the rest can recurse: not a call
    except ValueError:
        return None


def name_and_args(obj, keys: tuple[str, ...]) -> tuple[str, dict] | None:
    """(name, arguments) of a decoded JSON value that is a call: an object with a string `name` and its
    arguments (an object, or a JSON string of one) under the first of `keys` it has; else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None:
        return None
    args = obj[key]
    if isinstance(args, str):
        args = loads(args)
    return (obj["name"], args) if isinstance(args, dict) else None


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class JsonEnd:
    """Where a JSON object (or array) that a text starts with ends, read piece by piece: brackets are
    counted outside strings, so the end is found in one pass however the text is cut. Whether the
    bracketed text is valid JSON is for json.loads to say afterwards."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str) -> int | None:
        """Read on through `text`; the index just past the value's end, or None while it is open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


class CallStream:
    """The contract of every parser's stream: `feed(text)` returns [(content piece, None) | (None, (index,
    call))] in order, `index` counting the answer's calls from 0 (a streamed tool_calls delta's index);
    `finish()` returns the held text, which is content; `emitted` lists the calls so far. Feeding a text
    whole or in any pieces gives the same content and calls."""

    new_id = staticmethod(hex_id)

    def __init__(self):
        self.emitted: list[dict] = []

    def _emit(self, name: str, args, call_id: str | None = None) -> tuple[None, tuple[int, dict]]:
        """The next call, under the id the model wrote where it wrote one, else a new one."""
        call = make_call(name, args, self.new_id, call_id)
        self.emitted.append(call)
        return None, (len(self.emitted) - 1, call)

    def feed(self, text: str) -> list[tuple[str | None, tuple[int, dict] | None]]:
        raise NotImplementedError

    def finish(self) -> str:
        raise NotImplementedError
