"""The Responses API's items (server/http/responses_api.py) and what the chat machinery takes for them.

A request's `input` (a string, or a list of items: messages, `function_call`s the model made earlier,
`function_call_output`s the client sends back) is normalized into stored items with ids, and rendered as
the chat messages a chat template takes: consecutive function calls after an assistant message join it
as its `tool_calls` (one assistant turn, as the model wrote it), an output is a `tool` message. An answer
becomes output items: a `message` with one `output_text` part (its log-probabilities when asked), then a
`function_call` item for each tool call the model's tool-call parser read (server/http/tool_calls.py).

Responses' tools are flat (`{"type": "function", "name", "parameters"}`) where chat's nest them under
`function`; `tools_for_chat` and `choice_for_chat` translate. What a text-only model cannot take
(images, files, audio, built-in tools such as web search) is a 400 naming the field, never dropped.
"""

from __future__ import annotations

import uuid

from surge.errors import InvalidInput

ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content, where: str) -> str:
    """A message's content (a string or parts) as the text the template takes."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInput(f"{where}: content must be a string or a list of parts", param="input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            out.append(part.get("refusal") or "")
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            raise InvalidInput(f"{where}: content part type {kind!r} is not supported (this model reads text: "
                               "input_text / output_text)", param="input")
    return "".join(out)


def normalize_input(raw) -> list[dict]:
    """`input` as stored items, each with an id (the one the client gave, or a new one)."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("input must be a string or a non-empty list of items", param="input")
    items = []
    for k, item in enumerate(raw):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise InvalidInput(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidInput(f"{where}: role {role!r} is not one of {', '.join(ROLES)}", param="input")
            part = "output_text" if role == "assistant" else "input_text"
            text = _text(item.get("content"), where)
            items.append({"type": "message", "id": item.get("id") or new_id("msg"), "role": role,
                          "status": "completed", "content": [{"type": part, "text": text}]
                          if part == "input_text" else [{"type": part, "text": text, "annotations": []}]})
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not isinstance(item.get(field), str):
                    raise InvalidInput(f"{where}: a function_call needs a string {field}", param="input")
            items.append({"type": "function_call", "id": item.get("id") or new_id("fc"), "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidInput(f"{where}: a function_call_output needs a string call_id", param="input")
            items.append({"type": "function_call_output", "id": item.get("id") or new_id("fco"),
                          "call_id": item["call_id"], "output": _text(item.get("output"), where),
                          "status": "completed"})
        elif kind == "reasoning":  # a reasoning model's earlier thoughts: kept, not rendered again
            items.append({**item, "id": item.get("id") or new_id("rs")})
        else:
            raise InvalidInput(f"{where}: item type {kind!r} is not supported (message, function_call, "
                               "function_call_output, reasoning)", param="input")
    return items


def to_messages(items: list[dict]) -> list[dict]:
    """Stored items (inputs and earlier outputs) as chat messages."""
    messages: list[dict] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": "".join(p.get("text", "") for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """A function tool as chat clients send it, keys in their order (name, description, parameters), which
    templates write as they are."""
    fn = {"name": name}
    if description is not None:
        fn["description"] = description
    fn["parameters"] = parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def system_first(messages: list[dict]) -> list[dict]:
    """The system and developer messages (instructions, then those of the input, in order) joined into one
    leading system message, as vLLM renders a Responses conversation: most templates want one system message,
    first, and raise on another."""
    system = [m["content"] for m in messages if m["role"] in ("system", "developer") and m.get("content")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def tools_for_chat(tools: list | None) -> list[dict] | None:
    """Responses' flat function tools as chat's (what templates and the tool-call grammar read)."""
    if not tools:
        return None
    out = []
    for k, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidInput(f"tools[{k}]: tool type {kind!r} is not supported (function tools only)",
                               param="tools")
        if not isinstance(tool.get("name"), str):
            raise InvalidInput(f"tools[{k}]: a function tool needs a string name", param="tools")
        out.append(chat_tool(tool["name"], tool.get("description"), tool.get("parameters")))
    return out


def choice_for_chat(choice):
    """Responses' tool_choice as chat's: the strings as they are, {"type": "function", "name"} nested."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidInput("tool_choice must be none, auto, required or {'type': 'function', 'name': ...}",
                       param="tool_choice")


def text_format(text: dict | None) -> dict | None:
    """`text.format` as chat's response_format (a flat json_schema nests its schema)."""
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if text is not None and not isinstance(text, dict):
        raise InvalidInput("text must be an object", param="text")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidInput("text.format must be an object", param="text")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidInput("text.format json_schema needs a schema object", param="text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise InvalidInput(f"text.format type {fmt.get('type')!r} is not one of text, json_object, json_schema",
                       param="text")


def logprob_list(items) -> list[dict]:
    """The engine's per-token log-probabilities as OpenAI writes them (chat's `logprobs.content`, the
    Responses API's output_text `logprobs`)."""
    return [{"token": it["token"], "logprob": it["logprob"], "bytes": _bytes(it.get("bytes"), it["token"]),
             "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(b, t)}
                              for (t, v, _), b in zip(it["top"] or (), _top_bytes(it))]}
            for it in items or ()]


def _bytes(own, text: str) -> list[int]:
    """The token's own bytes (GenerateService._logprob; a split character's part, which its text cannot
    carry), or its text's where an item has none (one from an older cache entry)."""
    return own if own is not None else list(text.encode())


def _top_bytes(item) -> list:
    return item.get("top_bytes") or [None] * len(item["top"] or ())


def message_item(text: str, logprobs: list | None, status: str, item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [part]}


def call_item(call: dict, item_id: str | None = None) -> dict:
    """A tool call read from the answer (tool_calls.parse's chat form) as a function_call item."""
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
