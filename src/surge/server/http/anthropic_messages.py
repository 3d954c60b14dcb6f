"""Anthropic's Messages API on decoder models: POST /v1/messages (whole or streamed) and
POST /v1/messages/count_tokens, as the `anthropic` client and tools built on it (agents pointed at a
local model) call them.

A request is a chat underneath: `system` becomes the system message, the messages' text blocks the turns,
an assistant's `tool_use` blocks its tool calls and a user's `tool_result` blocks `tool` messages (before
the user's own text, as Anthropic orders them), rendered by the model's chat template. Custom `tools`
(`input_schema`), `tool_choice` (auto / any / tool / none, `disable_parallel_tool_use`) and
`output_config.format` (a JSON schema) go through the chat route's machinery (the model's tool-call parser,
guided decoding); `max_tokens` (required), `temperature`, `top_p`, `top_k` and `stop_sequences` are
honoured, and vLLM's `seed` and `ignore_eos`. With the model's reasoning parser the thinking is a
`thinking` block; `thinking: {"type": "disabled"}` turns a Qwen3 template's thinking off (its
`enable_thinking`), and `budget_tokens` is not enforced (the answer's `max_tokens` bounds both). Errors are Anthropic's `{"type": "error", "error":
{"type", "message"}}` (server/errors.py). What surge cannot do (images, documents, server tools,
`output_config.effort`, containers, MCP servers) is a 400 naming it, never dropped.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from surge.errors import InvalidInput
from surge.runtime.off_loop import prepared
from surge.server.http import generate_common
from surge.server.http.anthropic_events import MessageEvents
from surge.server.http.common import ORJSONResponse, checked_body, parse, validate
from surge.server.http.gil_points import each
from surge.server.http.generate_common import (EventStream, JsonAnswer, counted, deadline_for, generate_model,
                                               item_stream, make_params, prep_size, until_disconnect)
from surge.server.http.guided_fields import request_guide
from surge.server.http.openai_chat_requests import tool_calls_wanted
from surge.server.http.tool_calls import keep_special_tokens
from surge.server.http.openapi import body
from surge.server.http.reasoning import guide_after_thinking, request_parser
from surge.server.http.responses_items import chat_tool, new_id
from surge.server.state import AppState


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: Union[StrictStr, list[dict]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[each(AnthropicMessage)] = Field(..., min_length=1)
    max_tokens: int = Field(..., ge=1)
    system: Union[StrictStr, list[dict], None] = None
    stop_sequences: list[StrictStr] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None
    metadata: dict | None = None
    service_tier: StrictStr | None = None
    container: Union[StrictStr, dict, None] = None
    mcp_servers: list | None = None
    # vLLM's extras, as the other routes take them
    seed: int | None = None
    ignore_eos: bool = False


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[each(AnthropicMessage)] = Field(..., min_length=1)
    system: Union[StrictStr, list[dict], None] = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None


def _text(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise InvalidInput(f"{where}: content must be a string or a list of text blocks", param="messages")
    out = []
    for block in blocks or ():
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise InvalidInput(f"{where}: content block type {kind!r} is not supported here (text)",
                               param="messages")
        out.append(block["text"])
    return "".join(out)


def to_messages(req) -> list[dict]:
    """The request's system prompt and messages as chat messages."""
    out = [{"role": "system", "content": _text(req.system, "system")}] if req.system is not None else []
    for k, m in enumerate(req.messages):
        where = f"messages[{k}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, results = [], [], []
        for block in m.content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise InvalidInput(f"{where}: a tool_use block needs a string id and name", param="messages")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise InvalidInput(f"{where}: a tool_result block needs a string tool_use_id", param="messages")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": _text(block.get("content") or "", where)})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier thinking is not rendered again (as chat templates drop it)
            else:
                raise InvalidInput(f"{where}: content block type {kind!r} is not supported (text, tool_use, "
                                   "tool_result, thinking)", param="messages")
        out += results
        if text or calls or not results:
            msg = {"role": m.role, "content": "".join(text) if text or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def tools_for_chat(tools: list | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidInput(f"tools[{k}]: only custom tools with a name are supported (got type {kind!r})",
                               param="tools")
        out.append(chat_tool(tool["name"], tool.get("description"), tool.get("input_schema") or {"type": "object"}))
    return out


def choice_for_chat(choice: dict | None) -> tuple[object, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidInput("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                       param="tool_choice")


def _variables(req) -> dict | None:
    """Template variables: thinking disabled turns a Qwen3 template's thinking off."""
    kind = (req.thinking or {}).get("type") if isinstance(req.thinking, dict) else None
    if req.thinking is not None and kind not in ("enabled", "disabled", "adaptive"):
        raise InvalidInput("thinking.type must be enabled, disabled or adaptive", param="thinking")
    return {"enable_thinking": False} if kind == "disabled" else None


def _prompt(service, req) -> tuple[list[int], list | None, object, bool | None, dict | None]:
    tools = tools_for_chat(req.tools)
    choice, parallel = choice_for_chat(req.tool_choice)
    variables = _variables(req)
    text = service.render_chat(to_messages(req), tools=tools, variables=variables)
    return service.encode(text, special=False), tools, choice, parallel, variables


def _refuse_unsupported(req: MessagesRequest) -> None:
    config = req.output_config or {}
    if config.get("effort") is not None:
        raise InvalidInput("output_config.effort is not supported", param="output_config")
    if req.container is not None:
        raise InvalidInput("containers (server tools) are not supported", param="container")
    if req.mcp_servers:
        raise InvalidInput("MCP servers are not supported (the client runs its tools)", param="mcp_servers")


def _guide(req: MessagesRequest, service, tool_guide, reasoning: str):
    fmt = (req.output_config or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "json_schema"
                            or not isinstance(fmt.get("schema"), dict)):
        raise InvalidInput("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                           param="output_config")
    response_format = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}} if fmt else None
    try:
        guide = request_guide(SimpleNamespace(response_format=response_format), service, tool_guide)
    except InvalidInput as exc:  # named by this API's field
        raise InvalidInput(exc.message, param="tool_choice" if tool_guide else "output_config") from None
    if guide is not None and reasoning != "none":
        guide = guide_after_thinking(guide, service, None, tool_guide is not None,
                                     "tool_choice" if tool_guide is not None else "output_config")
    return guide


def _prepared(state: AppState, req: MessagesRequest):
    """(prompt ids, params, reasoning parser, tool-call parser, service, whether tool_choice forces calls): the
    work that grows with the request (the template's render, tokenization, the guide), on a thread for a large
    one (runtime/off_loop.py)."""
    _refuse_unsupported(req)
    service = generate_model(state, req.model)
    ids, tools, choice, parallel, variables = _prompt(service, req)
    parse_calls, tool_guide = tool_calls_wanted(SimpleNamespace(tools=tools, tool_choice=choice,
                                                                parallel_tool_calls=parallel), service)
    reasoning = request_parser(getattr(service.config, "reasoning_parser", "none"), variables)
    params = make_params(service, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                         top_k=req.top_k, stop=req.stop_sequences, seed=req.seed, ignore_eos=req.ignore_eos,
                         guide=_guide(req, service, tool_guide, reasoning),
                         skip_special_tokens=not keep_special_tokens(parse_calls))
    return ids, params, reasoning, parse_calls, service, tool_guide is not None


async def message_answer(state: AppState, req: MessagesRequest, receive) -> JsonAnswer | EventStream:
    """The answer to a validated request (route and hot path, as chat_answer)."""
    guided = bool((req.output_config or {}).get("format")) or \
        (isinstance(req.tool_choice, dict) and req.tool_choice.get("type") not in ("auto", "none"))
    ids, params, reasoning, parse_calls, service, forced = await prepared(prep_size(guided=guided), _prepared, state, req)
    base = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": service.name,
            "usage": {"input_tokens": len(ids), "output_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}}
    events = MessageEvents(base, reasoning, parse_calls, forced)
    headers = {"x-surge-model-version": service.version}
    deadline = deadline_for(state)
    if not req.stream:
        res = await until_disconnect(receive, counted(state, service, service.generate(ids, params,
                                                                                       deadline=deadline)))
        events.delta(res)
        events.finish(res)
        return JsonAnswer(events.message, headers)
    return await item_stream(state, service, ids, params, deadline, events)


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    @r.post("/v1/messages", name="messages", openapi_extra=body(MessagesRequest),
            responses={200: {"description": "The message, or with `stream` its events (text/event-stream)"}})
    async def create(request: Request):
        req = await parse(request, MessagesRequest, limits.max_body_bytes)
        return generate_common.respond(await message_answer(state, req, request.receive))

    @r.post("/v1/messages/count_tokens", name="count_tokens", openapi_extra=body(CountTokensRequest))
    async def count_tokens(request: Request):
        return await checked_body(request, functools.partial(_count_tokens, state), limits.max_body_bytes)

    return r


def _count_tokens(state: AppState, body) -> ORJSONResponse:
    """count_tokens' answer to a decoded body: its render and tokenization grow with the request, so a large
    one is counted on a preparation thread (common.checked_body)."""
    req = validate(CountTokensRequest, body)
    service = generate_model(state, req.model)
    choice_for_chat(req.tool_choice)
    ids = _prompt(service, req)[0]
    return ORJSONResponse({"input_tokens": len(ids)})


ANSWERS = {"/v1/messages": (MessagesRequest, message_answer, "messages")}

