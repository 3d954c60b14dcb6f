"""OpenAI's Responses API on decoder models: POST /v1/responses (whole, streamed, or in the background),
GET /v1/responses/{id}, DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel and
GET /v1/responses/{id}/input_items.

A request is a chat underneath: `instructions` and the input's system / developer messages become one
leading system message (as vLLM renders it: most templates want one, first), the input items (and with
`previous_response_id` the stored conversation before them: its inputs and outputs, not its
instructions) the messages, rendered by the model's chat template; function tools, `tool_choice` and
`text.format` (JSON schema / object) go through the chat route's machinery (tool-call parser, guided
decoding). `max_output_tokens`, `temperature`, `top_p`, `top_logprobs` with `include:
["message.output_text.logprobs"]`, `truncation: "auto"` (the oldest turns dropped until the prompt and
the answer fit) and `store` (default true) are honoured; `seed`, `top_k`, `min_p`,
`repetition_penalty` and `ignore_eos` are accepted as vLLM accepts them. A stream is the API's typed events
(`response.created` ... `response.output_text.delta` ... `response.completed` or
`response.incomplete`), each with its `sequence_number`, and no `[DONE]`. A background response is
answered at once (`queued`) and read back until it is done; `cancel` stops it, also from another
`--workers` front end (the store carries the request, runtime/response_store.py). What surge cannot
do (conversations, prompt templates, built-in tools, images, background streaming, reasoning summaries,
a reasoning effort on a model that does not reason) is a 400 naming the field; `reasoning.effort` goes to the
template as `reasoning_effort` ("none" / "minimal" turn a Qwen3 template's thinking off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import SimpleNamespace
from typing import ClassVar, Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from surge.errors import InvalidInput, NotFound, SurgeError
from surge.runtime.off_loop import prepared
from surge.runtime.response_store import store_for, valid_id
from surge.server.http import generate_common
from surge.server.http.common import ORJSONResponse, parse
from surge.server.http.delivery import unwatched
from surge.server.http.generate_common import (EventStream, JsonAnswer, counted, counted_stream, deadline_for,
                                               generate_model, item_stream, make_params, prep_size,
                                               until_disconnect)
from surge.server.http.guided_fields import request_guide
from surge.server.http.openai_chat_requests import tool_calls_wanted
from surge.server.http.tool_calls import keep_special_tokens
from surge.server.http.openapi import body
from surge.server.http.reasoning import effort_variables, guide_after_thinking, request_parser
from surge.server.http.responses_events import ResponseEvents
from surge.server.http.responses_items import (choice_for_chat, new_id, normalize_input, system_first, text_format,
                                               to_messages, tools_for_chat)
from surge.server.state import AppState

log = logging.getLogger("surge.responses")

LOGPROBS = "message.output_text.logprobs"
INCLUDES = (LOGPROBS, "reasoning.encrypted_content")
CANCEL_POLL_S = 0.25  # a background response reads its record for a cancel at most this often


class ResponseNotFound(NotFound):
    code = "not_found"


class ResponseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # what a bad `input` is told (server/http/common.validate): not the embeddings' strings and token ids
    union_hints: ClassVar[dict] = {"input": "expected a string or a list of input items (objects: messages, "
                                            "function_call, function_call_output)"}

    model: StrictStr | None = None
    input: Union[StrictStr, list[dict]]
    instructions: StrictStr | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[StrictStr] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: StrictStr | None = None
    tools: list[dict] | None = None
    tool_choice: Union[StrictStr, dict, None] = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)
    user: StrictStr | None = None
    reasoning: dict | None = None
    service_tier: StrictStr | None = None
    # what surge cannot honour: refused when set
    conversation: Union[StrictStr, dict, None] = None
    prompt: dict | None = None
    # vLLM's extras
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    priority: StrictInt = Field(0, description="vLLM's: lower runs first under the model's priority policy.")


def _store(state: AppState):
    store = state.extras.get("responses_store")
    if store is None:
        store = state.extras["responses_store"] = store_for(state.config.responses)
    return store


def _running(state: AppState) -> dict:
    """This process's background responses: id -> task."""
    return state.extras.setdefault("responses_running", {})


def _refuse_unsupported(req: ResponseRequest) -> None:
    for field in ("conversation", "prompt"):
        if getattr(req, field) is not None:
            raise InvalidInput(f"'{field}' is not supported (use previous_response_id to continue a "
                               "conversation)", param=field)
    if req.reasoning and any(v is not None for k, v in req.reasoning.items() if k != "effort"):
        raise InvalidInput("of 'reasoning', only effort is supported (no summaries)", param="reasoning")
    unknown = sorted(set(req.include or ()) - set(INCLUDES))
    if unknown:
        raise InvalidInput(f"include {', '.join(unknown)} is not supported ({', '.join(INCLUDES)})",
                           param="include")
    if req.background and not req.store:
        raise InvalidInput("background responses must be stored (store: true)", param="background")
    if req.background and req.stream:
        raise InvalidInput("background responses are not streamed; create it, then read it back",
                           param="stream")


class _Prepared(SimpleNamespace):
    """A request made ready for the engine: service, ids, params, parse_calls, forced (tool_choice required or
    named: a call cut by max_output_tokens is dropped, answer_blocks.py), input_items, held (the
    conversation its prompt holds: the stored context, then this input; truncation 'auto' may start it
    later), base (the response object without its outcome), want_lps,
    reasoning (the parser of the model's thinking), count (text -> its tokens)."""


async def _prepare(state: AppState, req: ResponseRequest) -> _Prepared:
    _refuse_unsupported(req)
    service = generate_model(state, req.model)
    context: list[dict] = []
    if req.previous_response_id is not None:
        prev = await _store(state).get(req.previous_response_id) if valid_id(req.previous_response_id) else None
        if prev is None:
            raise ResponseNotFound(f"previous response '{req.previous_response_id}' not found",
                                   param="previous_response_id")
        context = prev["conversation"]
    # a structured output's guide may take long to compile whatever the body's size: on a thread too
    guided = req.text is not None or req.tool_choice not in (None, "none", "auto")
    return await prepared(prep_size(guided=guided), _prepared, service, req, context)


def _prepared(service, req: ResponseRequest, context: list[dict]) -> _Prepared:
    """_prepare's work that grows with the request (the conversation's render and tokenization, truncation,
    the guide), on a thread for a large one (runtime/off_loop.py)."""
    items = normalize_input(req.input)
    tools = tools_for_chat(req.tools)
    chat = SimpleNamespace(tools=tools, tool_choice=choice_for_chat(req.tool_choice),
                           parallel_tool_calls=req.parallel_tool_calls)
    parse_calls, tool_guide = tool_calls_wanted(chat, service)
    guide = request_guide(SimpleNamespace(response_format=text_format(req.text)), service, tool_guide)
    parser = getattr(service.config, "reasoning_parser", "none")
    variables = effort_variables(parser, (req.reasoning or {}).get("effort"), None, "reasoning")
    reasoning = request_parser(parser, variables)
    if guide is not None and reasoning != "none":
        guide = guide_after_thinking(guide, service, None, tool_guide is not None,
                                     "tool_choice" if tool_guide is not None else "text")
    head = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    turns = to_messages(context + items)

    def prompt_ids(start: int) -> list[int]:
        return service.encode(service.render_chat(system_first(head + turns[start:]), tools=tools,
                                                  variables=variables), special=False)

    ids, held = prompt_ids(0), context + items
    if req.truncation == "auto" and not _fits(service, ids, req.max_output_tokens) and len(turns) > 1:
        cut, ids = _latest_that_fits(turns, prompt_ids, lambda ids: _fits(service, ids, req.max_output_tokens))
        held = _held_from(held, turns, cut)
    want_lps = LOGPROBS in (req.include or ()) or req.top_logprobs is not None
    params = make_params(service, max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                         top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                         repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos,
                         logprobs=(req.top_logprobs or 0) if want_lps else None, guide=guide, priority=req.priority,
                         skip_special_tokens=not keep_special_tokens(parse_calls))
    service.check_prompt(ids, params.max_tokens if params.own_max_tokens else None)
    rid = new_id("resp")
    base = {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": req.background, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": service.name,
        "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "service_tier": "default", "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_logprobs": req.top_logprobs,
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
        "usage": None, "user": req.user, "metadata": req.metadata or {},
    }
    return _Prepared(service=service, ids=ids, params=params, parse_calls=parse_calls, forced=tool_guide is not None,
                     input_items=items, held=held, base=base, want_lps=want_lps, reasoning=reasoning,
                     count=lambda text: service.encode(text, special=False))


def _fits(service, ids: list[int], max_tokens: int | None) -> bool:
    return len(ids) + (max_tokens or 1) <= service.max_model_len


def _latest_that_fits(turns: list[dict], prompt_ids, fits) -> tuple[int, list[int]]:
    """truncation 'auto' of a conversation whose whole prompt does not fit: (the turn it starts at, the
    prompt's ids) from the oldest turn whose cut fits (the conversation starts at a user message: a tool answer never loses
    the call it answers; at worst the last turn alone, fitting or not). Cuts are searched by halves (a
    shorter conversation renders a shorter prompt): one render per dropped turn took a request of
    thousands of turns minutes of the event loop (session 46)."""
    cuts = [k for k in range(1, len(turns)) if turns[k]["role"] == "user"]
    if not cuts or cuts[-1] != len(turns) - 1:
        cuts.append(len(turns) - 1)
    lo, hi, found = 0, len(cuts) - 1, {}
    while lo < hi:  # the first cut that fits; the last one if none does
        mid = (lo + hi) // 2
        found[mid] = prompt_ids(cuts[mid])
        if fits(found[mid]):
            hi = mid
        else:
            lo = mid + 1
    return cuts[lo], found[lo] if lo in found else prompt_ids(cuts[lo])


def _held_from(conversation: list[dict], turns: list[dict], cut: int) -> list[dict]:
    """The items (stored context, then the request's input) a truncated request's response is continued from:
    those from the user message its prompt started at (turns[cut]). A continuation, its conversation longer,
    could never fit an earlier start again, so this drops nothing its prompts would hold; storing them all
    let a chain of truncated requests grow its record, and each continuation's render, without bound
    (session 46). The response's input_items stay whole. A prompt of the last turn alone, not a user
    message, keeps them all."""
    if turns[cut]["role"] != "user":
        return conversation
    users = sum(1 for t in turns[:cut] if t["role"] == "user")  # user messages are items one for one
    seen = 0
    for k, item in enumerate(conversation):
        if item["type"] == "message" and item["role"] == "user":
            if seen == users:
                return conversation[k:]
            seen += 1
    return conversation


async def _keep(state: AppState, p: _Prepared, response: dict) -> None:
    """Store (with `store`) the response, its input items and the conversation a continuation starts from
    (its outputs once it is done)."""
    if p.base["store"]:
        done = response["status"] in ("completed", "incomplete")
        conversation = p.held + (response["output"] if done else [])
        await _store(state).put(response["id"], {"response": response, "input_items": p.input_items,
                                                 "conversation": conversation})


async def response_answer(state: AppState, req: ResponseRequest, receive) -> JsonAnswer | EventStream:
    """The answer to a validated create request (route and hot path, as chat_answer)."""
    p = await _prepare(state, req)
    service, deadline = p.service, deadline_for(state)
    headers = {"x-surge-model-version": service.version}
    if req.background:
        return JsonAnswer(await _start_background(state, p), headers)
    if not req.stream:
        res = await until_disconnect(receive, counted(state, service, service.generate(p.ids, p.params,
                                                                                       deadline=deadline)))
        events = ResponseEvents(p)  # the items a stream of it would have, made the same way
        events.delta(res)
        events.finish(res)
        await _keep(state, p, events.response)
        return JsonAnswer(events.response, headers)
    events = ResponseEvents(p)
    return await item_stream(state, service, p.ids, p.params, deadline, events,
                             after=lambda: _keep(state, p, events.response))


async def _start_background(state: AppState, p: _Prepared) -> dict:
    queued = {**p.base, "status": "queued"}
    await _keep(state, p, queued)
    task = asyncio.ensure_future(_run_background(state, p))
    running = _running(state)
    running[p.base["id"]] = task
    task.add_done_callback(lambda _: running.pop(p.base["id"], None))
    return queued


async def _stopped(store, rid: str) -> str | None:
    """Whether another process stopped a background response: "cancelled" (its record asks), "deleted"
    (its record is gone), or None."""
    record = await store.get(rid)
    if record is None:
        return "deleted"
    return "cancelled" if record.get("cancel_requested") else None


async def _run_background(state: AppState, p: _Prepared) -> None:
    """Runs a background response to its end, its record updated when it starts and ends. A cancel (in
    this process: the task is cancelled; from another: the record asks, read as tokens arrive) ends it
    as `cancelled`; a response deleted meanwhile stops and is not written again."""
    unwatched()  # its generation counts when it ends, not by the delivery of the request that queued it
    store, rid, service = _store(state), p.base["id"], p.service
    if await _stopped(store, rid):  # cancelled (or deleted) while queued
        return
    await _keep(state, p, {**p.base, "status": "in_progress"})
    events, d = ResponseEvents(p), None
    checked = time.monotonic()
    stream = counted_stream(state, service, service.stream(p.ids, p.params, deadline=deadline_for(state)))
    try:
        async for d in stream:
            events.delta(d)
            if time.monotonic() - checked > CANCEL_POLL_S:
                checked = time.monotonic()
                if await _stopped(store, rid):
                    raise asyncio.CancelledError
    except asyncio.CancelledError:
        if await _stopped(store, rid) != "deleted":
            await _keep(state, p, {**p.base, "status": "cancelled", "output": events.cut()})
        return
    except SurgeError as exc:
        await _keep(state, p, {**p.base, "status": "failed", "error": {"code": exc.code, "message": exc.message}})
        return
    except Exception:  # the record must not stay in_progress forever
        # whoever reads the record back gets what a foreground request's 500 says; the text goes to the log
        log.exception("background response %s failed", rid)
        error = {"code": "internal_error", "message": "internal server error"}
        await _keep(state, p, {**p.base, "status": "failed", "error": error})
        return
    finally:
        await stream.aclose()
    events.finish(d)
    stopped = await _stopped(store, rid)
    if stopped != "deleted":
        finished = events.response if stopped is None else {**p.base, "status": "cancelled", "output": events.output}
        await _keep(state, p, finished)


async def _record(state: AppState, rid: str) -> dict:
    record = await _store(state).get(rid) if valid_id(rid) else None
    if record is None:
        raise ResponseNotFound(f"response '{rid}' not found", param="response_id")
    return record


async def _cancel(state: AppState, rid: str) -> dict:
    record = await _record(state, rid)
    response = record["response"]
    if not response.get("background"):
        raise InvalidInput("only background responses can be cancelled", param="response_id")
    if response["status"] not in ("queued", "in_progress"):
        return response  # already over: as it ended
    task = _running(state).get(rid)
    if task is not None:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        record = await _store(state).get(rid) or record
    cancelled = {**record, "cancel_requested": True, "response": {**record["response"], "status": "cancelled"}}
    if task is not None or record["response"]["status"] != "cancelled":
        # here: marks a task cancelled before it ran; elsewhere: the runner reads the request as its
        # tokens arrive and then writes what it made
        await _store(state).put(rid, cancelled)
    return cancelled["response"]


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    @r.post("/v1/responses", name="responses", openapi_extra=body(ResponseRequest),
            responses={200: {"description": "The response object, or with `stream` its typed events "
                             "(text/event-stream)"}})
    async def create(request: Request):
        req = await parse(request, ResponseRequest, limits.max_body_bytes)
        return generate_common.respond(await response_answer(state, req, request.receive))

    @r.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False):
        if stream:
            raise InvalidInput("streaming a stored response again is not supported", param="stream")
        return ORJSONResponse((await _record(state, response_id))["response"])

    @r.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        record = await _record(state, response_id)
        if record["response"].get("background") and record["response"]["status"] in ("queued", "in_progress"):
            await _cancel(state, response_id)
        await _store(state).delete(response_id)
        return ORJSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @r.post("/v1/responses/{response_id}/cancel", openapi_extra=body(required=False))
    async def cancel(response_id: str):
        return ORJSONResponse(await _cancel(state, response_id))

    @r.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, limit: int = 20, order: Literal["asc", "desc"] = "desc",
                          after: str | None = None):
        if not 1 <= limit <= 100:
            raise InvalidInput("limit must be in [1, 100]", param="limit")
        items = list((await _record(state, response_id))["input_items"])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise InvalidInput(f"item '{after}' is not an input item of this response", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return ORJSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                               "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    return r


ANSWERS = {"/v1/responses": (ResponseRequest, response_answer, "responses")}
