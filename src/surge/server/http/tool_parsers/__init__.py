"""Tool-call parsers (vLLM's `--tool-call-parser`, surge's `GenerationConfig.tool_call_parser`): each reads one
model family's way of writing calls out of its answer, whole or streamed, and writes the grammar that a
forced tool choice (tool_choice "required" or a named function) holds the answer to, in that same format.

- `hermes`: `<tool_call>{json}</tool_call>` blocks (Qwen2.5, Hermes; hermes.py);
- `llama3_json`: the answer is `{"name": ..., "parameters": {...}}` objects joined by `; ` (Llama 3.x;
  llama3_json.py);
- `mistral`: `[TOOL_CALLS]` then a JSON array of calls, or `name{json}` (Mistral; mistral.py).

Each parser module has a stream class (the `CallStream` contract of common.py), `ARGS_KEY` (the key its
grammar writes the arguments under) and `grammar(many, literal)` (the `start` rule over a `body` rule
that is one call's JSON; `literal` writes a tag as the model's token or as text).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from surge.server.http.tool_parsers import hermes, llama3_json, mistral
from surge.server.http.tool_parsers.common import CallStream


@dataclass(frozen=True)
class ToolParser:
    name: str
    stream: Callable[[], CallStream]
    args_key: str
    grammar: Callable[[bool, Callable[[str], str]], str]
    keep_special_tokens: bool = False  # its tag is a special token the text must keep (vLLM's adjust_request)


REGISTRY = {
    "hermes": ToolParser("hermes", hermes.HermesStream, hermes.ARGS_KEY, hermes.grammar),
    "llama3_json": ToolParser("llama3_json", llama3_json.Llama3JsonStream, llama3_json.ARGS_KEY,
                              llama3_json.grammar),
    "mistral": ToolParser("mistral", mistral.MistralStream, mistral.ARGS_KEY, mistral.grammar,
                          keep_special_tokens=True),
}
PARSERS = ("none", *REGISTRY)


def get(name: str) -> ToolParser:
    """The parser of that name."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r} (one of {', '.join(PARSERS)})") from None
