"""Tool calls in a chat model's output, read by the model's `GenerationConfig.tool_call_parser` (vLLM's
--tool-call-parser): `hermes`, `llama3_json` or `mistral` (server/http/tool_parsers/, one module each; the
formats are described there).

Each call becomes an OpenAI tool call ({"id", "type": "function", "function": {"name", "arguments"}},
`arguments` a JSON string) and leaves the message's content; text that is not a call stays content, as
written. `stream(parser)` does the same over a stream (`feed` / `finish` / `emitted`): content is passed on
as it comes, except text that may still become a call; a call goes out whole once it is complete. Whole
and streamed answers are equal however the text is cut.
"""

from __future__ import annotations

from surge.server.http.tool_parsers import PARSERS, get
from surge.server.http.tool_parsers.common import CallStream

__all__ = ["PARSERS", "CallStream", "keep_special_tokens", "parse", "stream"]


def stream(parser: str | None) -> CallStream | None:
    """A fresh stream of the parser's calls; None for None (calls are not read)."""
    return None if parser is None else get(parser).stream()


def keep_special_tokens(parser: str | None) -> bool:
    """Whether the answer's text must keep special tokens for the parser to see its tag (mistral)."""
    return parser is not None and get(parser).keep_special_tokens


def parse(text: str, parser: str = "hermes", forced: bool = False) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole answer; content None when only calls were written. `forced`: the
    answer was held to calls (tool_choice required or named): text still held as a call's start at the end
    (a call cut by max_tokens) is dropped, not content."""
    s = get(parser).stream()
    content = "".join(piece for piece, _ in s.feed(text) if piece)
    rest = s.finish()
    content += "" if forced else rest
    calls = s.emitted
    if calls and not content.strip():
        return None, calls
    return content, calls
