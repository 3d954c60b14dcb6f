"""A reasoning model's thinking, separated from its answer: vLLM's `--reasoning-parser`, which
`GenerationConfig.reasoning_parser` turns on. DeepSeek-R1 (and its Qwen2 / Llama distills, QwQ) and Qwen3
write their thinking between `<think>` and `</think>`; the chat answer's message carries it in
`reasoning`, and `content` keeps only the answer (where a `tool_call_parser` then reads the calls).

The rules follow vLLM's parsers as of 2026 (vllm/reasoning/basic_parsers.py, deepseek_r1_reasoning_parser.py,
qwen3_reasoning_parser.py):

- `deepseek_r1`: a `<think>` the answer starts with is dropped (many templates write it into the prompt,
  so the answer often starts inside the thinking); the text before the first `</think>` is the reasoning,
  the text after it the content (None when empty); an answer without `</think>` is all reasoning (it was
  cut off while thinking).
- `qwen3`: the same rules (vLLM's qwen3 parser once wanted both tags, else all content; since Qwen3.5 and
  the templates that put `<think>` in the prompt, it reads a missing `</think>` as reasoning too), except
  that a request whose `chat_template_kwargs` sets `enable_thinking` false is all content: its template
  closed the thinking in the prompt.

The field is `reasoning`, the name vLLM has used since it renamed DeepSeek's `reasoning_content` (PR 27752,
2025-10, following OpenAI's guidance for chain of thought in chat completions) and then removed the old
name (PR 33402, 2026-01): vLLM today sends `reasoning` only, and so does surge. A request's
`include_reasoning: false` (vLLM's field) drops the reasoning from the answer. A structured output
(`response_format` etc., or a required / named tool choice) holds only the answer: its grammar starts after
the model's `</think>` token (`guide_after_thinking`), as vLLM starts it when the reasoning ends.

Where surge is stricter than vLLM, so that a streamed answer always equals the whole one: a `<think>`
is dropped only at the start of the answer (after whitespace, which goes with it), where vLLM's whole-answer
parser drops anything before a `<think>` anywhere while its stream passes it on as reasoning; and qwen3's
`enable_thinking: false` makes the whole answer content, as vLLM streams it (its whole answer would still
split at a `</think>` the model wrote anyway). vLLM's qwen3 rule that a `<tool_call>` followed by
`<function=` ends the thinking (Qwen3.5's XML tool calls, which surge does not parse) is left out.

`ReasoningStream` does the same over a stream: text goes out as it comes, except a tail that may be the
start of a tag, held until it is known not to be one (as the hermes tool-call stream holds `<tool_call>`);
its pieces, joined field by field, are `split` of the whole answer however the text was cut.
"""

from __future__ import annotations

from surge.errors import InvalidInput
from surge.runtime.guided import after_reasoning
from surge.server.http.guided_fields import FIELDS
from surge.server.http.tool_calls import stream as call_stream
from surge.server.http.tool_calls import parse as parse_tool_calls

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("none", "deepseek_r1", "qwen3")
REASONING, CONTENT = "reasoning", "content"


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def effort_variables(parser: str, effort: str | None, variables: dict | None, param: str) -> dict | None:
    """The template variables of a request's reasoning effort (OpenAI's chat `reasoning_effort`, the Responses
    API's `reasoning.effort`): the template gets it as `reasoning_effort` (as vLLM passes it; templates that
    read it, e.g. gpt-oss's, use it), and "none" / "minimal" turn a Qwen3 template's thinking off
    (`enable_thinking` false) unless the request set that itself. A model without a reasoning parser has no
    effort to set: 400 naming `param`."""
    if effort is None:
        return variables
    if effort not in EFFORTS:
        raise InvalidInput(f"reasoning effort must be one of {', '.join(EFFORTS)}", param=param)
    if parser == "none":
        raise InvalidInput("this model does not reason (no reasoning_parser): a reasoning effort has nothing to "
                           "set", param=param)
    out = {"reasoning_effort": effort, **(variables or {})}
    if parser == "qwen3" and effort in ("none", "minimal"):
        out.setdefault("enable_thinking", False)
    return out


def request_parser(parser: str, template_variables: dict | None) -> str:
    """The parser a chat request's answer is read with: the model's, or "none" where the request turned
    Qwen3's thinking off (`chat_template_kwargs` enable_thinking false)."""
    if parser == "qwen3" and not (template_variables or {}).get("enable_thinking", True):
        return "none"
    return parser


def guide_after_thinking(guide: tuple[str, str], service, req, from_tool_choice: bool,
                         param: str | None = None) -> tuple[str, str]:
    """A request's structured output (or forced tool choice) held from the end of the thinking on, as vLLM
    applies it with a reasoning parser (runtime.guided.after_reasoning): the thinking is free and the
    guide starts after the model's `</think>` token. A model whose tokenizer has no such token (the tag
    only as text) gets 400 for the combination, as vLLM will not start such a parser."""
    param = param or ("tool_choice" if from_tool_choice else
                      next((f for f in FIELDS[1:] if getattr(req, f, None) is not None), "response_format"))
    literal = service.guide_literal(CLOSE)
    if not (literal.startswith("<[") and literal.endswith("]>")):
        raise InvalidInput(f"model '{service.name}' has no {CLOSE} token, so a structured output cannot start "
                           "after its thinking (reasoning_parser); ask without one, or serve the model without "
                           "the reasoning parser", param=param)
    wrapped = after_reasoning(guide, int(literal[2:-2]))
    service.check_guide(wrapped, param)
    return wrapped


def split(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer: reasoning None when `parser` is "none", content None when
    the answer has none (no `</think>`, or nothing after it)."""
    if parser == "none":
        return None, text
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(PARSERS)})")
    stripped = text.lstrip()
    if stripped.startswith(OPEN):
        text = stripped[len(OPEN):]
    reasoning, sep, content = text.partition(CLOSE)
    if not sep:
        return text, None
    return reasoning, content or None


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that begins `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Feed an answer's text as it is generated; `feed` and `finish` return [(field, piece)] in order,
    field "reasoning" or "content" (with parser "none" everything is content)."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(PARSERS)})")
        self._state = CONTENT if parser == "none" else "start"  # start -> reasoning -> content
        self._buf = ""

    @property
    def answering(self) -> bool:
        """Past the thinking: what comes now is content."""
        return self._state == CONTENT

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self._state == CONTENT:
            return [(CONTENT, text)] if text else []
        self._buf += text
        out: list[tuple[str, str]] = []
        if self._state == "start":  # only whitespace so far, perhaps then part of a leading <think>
            rest = self._buf.lstrip()
            if rest.startswith(OPEN):
                self._buf = rest[len(OPEN):]
            elif OPEN.startswith(rest):
                return out
            self._state = REASONING
        end = self._buf.find(CLOSE)
        if end >= 0:
            if end:
                out.append((REASONING, self._buf[:end]))
            rest, self._buf, self._state = self._buf[end + len(CLOSE):], "", CONTENT
            if rest:
                out.append((CONTENT, rest))
            return out
        keep = _held(self._buf, CLOSE)
        ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        if ready:
            out.append((REASONING, ready))
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end: a partial tag is reasoning, as the answer never closed its thinking."""
        rest, self._buf = self._buf, ""
        return [(REASONING, rest)] if rest and self._state != CONTENT else []


def message(text: str, parser: str, parse_calls: str | None, include_reasoning: bool = True,
            forced: bool = False) -> tuple[dict, bool]:
    """(the assistant message of a whole answer, whether it has tool calls): its reasoning (with a parser),
    then its content, whose tool calls are read with the tool-call parser `parse_calls` (None: not read).
    `forced`: tool_choice required or named, whose answer is calls only: a call cut short is dropped."""
    reasoning, content = split(text, parser)
    msg: dict = {"role": "assistant", "content": content}
    if parser != "none" and include_reasoning:
        msg[REASONING] = reasoning
    if parse_calls is not None and content is not None:
        content, calls = parse_tool_calls(content, parse_calls, forced)
        if calls:
            msg.update(content=content, tool_calls=calls)
            return msg, True
    return msg, False


class ChatDeltas:
    """One streamed chat choice's text as delta fields: {"reasoning": piece} while it thinks (with a
    parser), then {"content": piece}, or {"tool_calls": [...]} for a call read from the content (with
    the tool-call parser `parse_calls`). `called`: whether a call went out (finish_reason tool_calls).
    `forced`: as `message`'s (a call cut short at the end is dropped, not content)."""

    def __init__(self, parser: str, parse_calls: str | None, include_reasoning: bool = True, forced: bool = False):
        self._reasoning = ReasoningStream(parser)
        self._calls = call_stream(parse_calls)
        self._include = include_reasoning
        self._forced = forced

    @property
    def called(self) -> bool:
        return bool(self._calls and self._calls.emitted)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        pieces = self._reasoning.feed(text) + (self._reasoning.finish() if final else [])
        out: list[dict] = []
        for field, piece in pieces:
            if field == REASONING:
                if self._include:
                    out.append({REASONING: piece})
            elif self._calls is None:
                out.append({CONTENT: piece})
            else:  # forced calls: what is between them (a newline) is no content, as a whole answer's is not
                out += [d for d in _call_deltas(self._calls.feed(piece))
                        if not (self._forced and CONTENT in d and not d[CONTENT].strip())]
        if final and self._calls is not None:
            rest = self._calls.finish()
            out += _call_deltas([("" if self._forced else rest, None)])
        return out


def _call_deltas(pieces) -> list[dict]:
    out = []
    for text, call in pieces:
        if call is not None:
            index, call = call
            out.append({"tool_calls": [{"index": index, **call}]})
        elif text:
            out.append({CONTENT: text})
    return out
