"""OpenAI-compatible generation: POST /v1/chat/completions and /v1/completions, streamed or not.

Chat messages are rendered with the model's chat template (as transformers'
apply_chat_template does) and tokenized without special tokens, since the
template writes them. Streams are server-sent events ending in `data: [DONE]`;
with `stream_options.include_usage` the last chunk before it carries the usage.
Beyond OpenAI's fields, vLLM's `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `min_tokens`, `allowed_token_ids`, `bad_words`,
`include_stop_str_in_output`, `skip_special_tokens`, `truncate_prompt_tokens` and `prompt_logprobs`
(each completion choice's, the chat response's; not streamed, as vLLM) are accepted, and on chats its
template controls `add_generation_prompt`, `continue_final_message` and
`chat_template_kwargs`. Structured outputs (`response_format`
json_object / json_schema, vLLM's `guided_*` fields and `structured_outputs`, a required or
named `tool_choice`) constrain the answer token by token (server/http/guided_fields.py).
OpenAI fields surge cannot honour (tool calls without a parser, `suffix`, `best_of` other
than `n`, audio and other modalities, web search, the deprecated `functions`) are refused with 400,
never ignored; unknown fields are ignored, as vLLM does.
Tool calls are read from the answer with the model's `tool_call_parser`
(server/http/tool_calls.py). With the model's `reasoning_parser` (vLLM's --reasoning-parser: deepseek_r1,
qwen3) a reasoning model's thinking goes in the message's (or delta's) `reasoning` field and `content` keeps
the answer, whose tool calls are then read; a structured output then holds only the answer, after the
thinking (server/http/reasoning.py).
The request bodies and what is read off them before generating: server/http/openai_chat_requests.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request

from surge.errors import InvalidInput
from surge.server.http.common import parse
from surge.server.http import generate_common
from surge.server.http.generate_choices import check_count, choice_params, first_deltas, merged
from surge.server.http.guided_fields import request_guide
from surge.server.http.openai_chat_requests import (ChatCompletionRequest, CompletionRequest, _prompts,
                                                    _refuse_chat_fields, _refuse_stream_options, _truncated,
                                                    _vllm_extras, chat_messages, prompt_logprobs_wanted,
                                                    tool_calls_wanted)
from surge.server.http.tool_calls import keep_special_tokens
from surge.server.http.reasoning import (ChatDeltas, effort_variables, guide_after_thinking, message,
                                         request_parser)
from surge.server.http.responses_items import logprob_list
from surge.server.kserve_generate_outputs import vllm_entry
from surge.server.http.generate_common import (EventStream, JsonAnswer, counted, counted_stream, deadline_for,
                                               generate_model, make_params, prep_size, sse, until_disconnect)
from surge.runtime.off_loop import prepared
from surge.server.http.openapi import body
from surge.server.state import AppState


ANSWER_OR_STREAM = {200: {"description": "The answer (JSON), or with `stream` server-sent events ending in "
                               "`data: [DONE]`", "content": {"application/json": {"schema": {"type": "object"}},
                                                             "text/event-stream": {"schema": {"type": "string"}}}}}


def _chat_logprobs(items) -> dict | None:
    return None if items is None else {"content": logprob_list(items)}


def _completion_logprobs(items, offset0: int = 0) -> dict | None:
    if items is None:
        return None
    offsets, pos = [], offset0
    for it in items:
        offsets.append(pos)
        pos += len(it["token"])
    return {"tokens": [it["token"] for it in items], "token_logprobs": [it["logprob"] for it in items],
            "top_logprobs": [_top_with_chosen(it) for it in items], "text_offset": offsets}


def _top_with_chosen(item) -> dict | None:
    """OpenAI's legacy completions "always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements" (vLLM's too): the chosen token joins its top ones where it is not among them."""
    if item["top"] is None:
        return None
    top = {t: v for t, v, _ in item["top"]}
    if item["logprob"] is not None:
        top.setdefault(item["token"], item["logprob"])
    return top


def _joined(echo: dict | None, out: dict | None) -> dict | None:
    """An echoed prompt's logprobs followed by the completion's (whose offsets already count the prompt)."""
    if echo is None or out is None:
        return echo or out
    return {k: echo[k] + out[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _prompt_logprobs(scored) -> list:
    """vLLM's `prompt_logprobs`: None for the prompt's first token, then each token's {token id: {logprob, rank,
    decoded_token}}, the token itself and the top ones."""
    return [None, *(vllm_entry(it) for it in scored or [])]


def _top(scored, k: int):
    """Scored prompt tokens with only their `k` best alternatives (the prompt was scored for the larger ask)."""
    return [{**it, "top": it["top"][:k]} for it in scored or []]


def _usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; `cached`: the prompt's tokens found in the prefix cache (prompt_tokens_details)."""
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _error_body(exc) -> dict:
    return {"error": {"message": exc.message, "type": exc.openai_type, "param": exc.param, "code": exc.code}}


def _chat_prepared(state: AppState, req: ChatCompletionRequest):
    """(service, prompt ids, params, tool-call parser, reasoning parser, whether tool_choice forces calls) of a
    chat request: the work that grows with it (its template's render, tokenization, bad words, guide), on a
    thread for a large one."""
    service = generate_model(state, req.model)
    _refuse_chat_fields(req)
    check_count(1, req.n, state.config.limits.max_inputs_per_request)
    prompt_k = prompt_logprobs_wanted(req)
    parse_calls, tool_guide = tool_calls_wanted(req, service)
    guide = request_guide(req, service, tool_guide)
    parser = getattr(service.config, "reasoning_parser", "none")
    variables = effort_variables(parser, req.reasoning_effort, req.chat_template_kwargs, "reasoning_effort")
    reasoning = request_parser(parser, variables)
    if guide is not None and reasoning != "none":
        guide = guide_after_thinking(guide, service, req, tool_guide is not None)
    tools = req.tools if req.tools else None
    prompt = service.render_chat(chat_messages(req.messages), add_generation_prompt=req.add_generation_prompt,
                                 tools=tools, continue_final_message=req.continue_final_message,
                                 variables=variables)
    ids = _truncated(service.encode(prompt, special=False), req.truncate_prompt_tokens)
    params = make_params(service, max_tokens=req.max_completion_tokens or req.max_tokens,
                         temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                         seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                         presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                         repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos,
                         logprobs=(req.top_logprobs or 0) if req.logprobs else None, logit_bias=req.logit_bias,
                         prompt_logprobs=prompt_k, guide=guide, **_vllm_extras(req, keep_special_tokens(parse_calls)))
    return service, ids, params, parse_calls, reasoning, tool_guide is not None


async def chat_answer(state: AppState, req: ChatCompletionRequest, receive) -> JsonAnswer | EventStream:
    """The answer to a validated chat request (`receive`: the request's ASGI receive, to notice a client
    that leaves while a non-streamed answer is computed). The route and the hot path
    (server/http/generate_hotpath.py) both answer with it."""
    service, ids, params, parse_calls, reasoning, forced = await prepared(prep_size(req), _chat_prepared, state, req)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    deadline = deadline_for(state)
    choices = choice_params(params, req.n)
    if not req.stream:
        results = await until_disconnect(receive, _gather(
            [counted(state, service, service.generate(ids, p, deadline=deadline)) for p in choices]))
        answer = {
            "id": rid, "object": "chat.completion", "created": created, "model": service.name,
            "choices": [_chat_choice(j, res, parse_calls, reasoning, req.include_reasoning, forced)
                        for j, res in enumerate(results)],
            "usage": _usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results),
                            results[0].cached_tokens),
        }
        if params.prompt_logprobs is not None:  # vLLM's: the rendered prompt's, on the response
            answer["prompt_logprobs"] = _prompt_logprobs(results[0].prompt_logprobs)
        return JsonAnswer(answer, {"x-surge-model-version": service.version})
    usage = bool(req.stream_options and req.stream_options.include_usage)

    running = usage and req.stream_options.continuous_usage_stats
    made = [0] * req.n  # each choice's tokens so far

    def chunk(index: int, delta: dict, finish=None, logprobs=None, stop_reason=None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": service.name,
             "choices": [choice]}
        if usage:
            c["usage"] = _usage(len(ids), made[index]) if running else None
        return sse(c)

    agens = [counted_stream(state, service, service.stream(ids, p, deadline=deadline)) for p in choices]
    firsts = await first_deltas(agens)  # errors before any output keep their HTTP status
    deltas = merged(agens, firsts)

    parsed = [ChatDeltas(reasoning, parse_calls, req.include_reasoning, forced) for _ in agens] \
        if parse_calls or reasoning != "none" else None

    async def rest():
        for j in range(len(agens)):
            yield chunk(j, {"role": "assistant", "content": ""})
        prompt_tokens = completion_tokens = cached = 0
        async for j, d in deltas:
            finish = d.finish_reason
            made[j] = d.completion_tokens
            if parsed is None:
                if d.text or d.logprobs:
                    yield chunk(j, {"content": d.text}, logprobs=_chat_logprobs(d.logprobs))
            else:  # reasoning, content and tool calls (server/http/reasoning.py)
                pieces = parsed[j].feed(d.text, finish is not None) or ([{"content": ""}] if d.logprobs else [])
                for k, piece in enumerate(pieces):  # the delta's log-probabilities go with its first piece
                    yield chunk(j, piece, logprobs=_chat_logprobs(d.logprobs) if k == 0 else None)
                if finish is not None and parsed[j].called and not (forced and finish == "length"):
                    finish = "tool_calls"
            if finish is not None:
                yield chunk(j, {}, finish=finish, stop_reason=d.stop_reason)
                prompt_tokens, completion_tokens = d.prompt_tokens, completion_tokens + d.completion_tokens
                cached = d.cached_tokens if j == 0 else cached
        if usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": service.name,
                       "choices": [], "usage": _usage(prompt_tokens, completion_tokens, cached)})

    return EventStream(rest(), _error_body, close=_closer(deltas, agens))


def _completion_prepared(state: AppState, req: CompletionRequest):
    """(service, [(prompt ids, echoed text)], params) of a completions request (as _chat_prepared)."""
    limits = state.config.limits
    service = generate_model(state, req.model)
    _refuse_stream_options(req)
    if req.suffix:
        raise InvalidInput("'suffix' is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidInput("'best_of' other than n is not supported (surge does not rank choices)", param="best_of")
    prompt_k = prompt_logprobs_wanted(req)
    prompts = _prompts(req.prompt, service, limits.max_inputs_per_request, req.echo, req.truncate_prompt_tokens)
    check_count(len(prompts), req.n, limits.max_inputs_per_request)
    # the prompt scored once for both: echo's `logprobs` and vLLM's `prompt_logprobs` (each takes its top ones)
    echo_k = req.logprobs if req.echo else None
    wanted = [k for k in (prompt_k, echo_k) if k is not None]
    params = make_params(service, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                         top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop,
                         stop_token_ids=req.stop_token_ids, presence_penalty=req.presence_penalty,
                         frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                         ignore_eos=req.ignore_eos, logprobs=req.logprobs, logit_bias=req.logit_bias,
                         prompt_logprobs=max(wanted) if wanted else None, guide=request_guide(req, service),
                         **_vllm_extras(req))
    return service, prompts, params


async def completion_answer(state: AppState, req: CompletionRequest, receive) -> JsonAnswer | EventStream:
    """The answer to a validated completions request; as `chat_answer`. Choice i * n + j is prompt i's
    choice j."""
    service, prompts, params = await prepared(prep_size(req), _completion_prepared, state, req)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    deadline = deadline_for(state)
    jobs = [(ids, p) for ids, _ in prompts for p in choice_params(params, req.n)]
    echoed = [text for _, text in prompts for _ in range(req.n)]

    def echo_logprobs(k: int, scored) -> dict | None:
        """Choice k's prompt as `logprobs` (the first token has none, as OpenAI's echo)."""
        if not (req.echo and req.logprobs is not None):
            return None
        ids = jobs[k][0]
        first = {"token": service.decode([ids[0]]), "logprob": None, "top": None}
        return _completion_logprobs([first, *_top(scored, req.logprobs)])  # prompt_logprobs may want more
    if not req.stream:
        results = await until_disconnect(receive, _gather(
            [counted(state, service, service.generate(ids, p, deadline=deadline)) for ids, p in jobs]))
        return JsonAnswer({
            "id": rid, "object": "text_completion", "created": created, "model": service.name,
            "choices": [{"index": k, "text": echoed[k] + res.text,
                         "logprobs": _joined(echo_logprobs(k, res.prompt_logprobs),
                                             _completion_logprobs(res.logprobs, len(echoed[k]))),
                         "finish_reason": res.finish_reason, "stop_reason": res.stop_reason,
                         **({"prompt_logprobs": _prompt_logprobs(_top(res.prompt_logprobs, req.prompt_logprobs))}
                            if req.prompt_logprobs is not None else {})}
                        for k, res in enumerate(results)],
            # a prompt counts once however many choices it has (as OpenAI counts it)
            "usage": _usage(sum(r.prompt_tokens for r in results[::req.n]),
                            sum(r.completion_tokens for r in results), sum(r.cached_tokens for r in results[::req.n])),
        }, {"x-surge-model-version": service.version})
    usage = bool(req.stream_options and req.stream_options.include_usage)

    running = usage and req.stream_options.continuous_usage_stats
    made = [0] * len(jobs)  # each choice's tokens so far

    def chunk(index: int, text: str, finish=None, logprobs=None, stop_reason=None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        c = {"id": rid, "object": "text_completion", "created": created, "model": service.name,
             "choices": [choice]}
        if usage:
            c["usage"] = _usage(len(jobs[index][0]), made[index]) if running else None
        return sse(c)

    agens = [counted_stream(state, service, service.stream(ids, p, deadline=deadline)) for ids, p in jobs]
    firsts = await first_deltas(agens)
    deltas = merged(agens, firsts)

    async def rest():
        offsets = [len(text) for text in echoed]
        for k, text in enumerate(echoed):
            if text:
                yield chunk(k, text, logprobs=echo_logprobs(k, firsts[k].prompt_logprobs))
        prompt_tokens = completion_tokens = cached = 0
        async for k, d in deltas:
            made[k] = d.completion_tokens
            if d.text or d.finish_reason is not None or d.logprobs:
                yield chunk(k, d.text, d.finish_reason, _completion_logprobs(d.logprobs, offsets[k]), d.stop_reason)
                # by the tokens' texts, as the whole answer counts them: a delta's text lags its tokens
                # while its end may begin a stop string
                offsets[k] += sum(len(it["token"]) for it in d.logprobs) if d.logprobs else len(d.text)
            if d.finish_reason is not None:
                prompt_tokens += d.prompt_tokens if k % req.n == 0 else 0
                cached += d.cached_tokens if k % req.n == 0 else 0
                completion_tokens += d.completion_tokens
        if usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": service.name,
                       "choices": [], "usage": _usage(prompt_tokens, completion_tokens, cached)})

    return EventStream(rest(), _error_body, close=_closer(deltas, agens))


def _chat_choice(index: int, res, parse_calls: str | None, reasoning: str = "none",
                 include_reasoning: bool = True, forced: bool = False) -> dict:
    msg, called = message(res.text, reasoning, parse_calls, include_reasoning, forced)
    # a forced answer cut by max_tokens says so (vLLM's required tool choice: "tool_calls" only when it ended)
    finish = "tool_calls" if called and not (forced and res.finish_reason == "length") else res.finish_reason
    return {"index": index, "message": msg, "logprobs": _chat_logprobs(res.logprobs), "finish_reason": finish,
            "stop_reason": res.stop_reason}



async def _gather(works: list) -> list:
    """Every choice's result; the first failure (a 429 for the tenth choice, say) cancels the others, whose
    sequences would otherwise run on for nobody (asyncio.gather leaves them running)."""
    if len(works) == 1:
        return [await works[0]]
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# path -> (request model, answer, route name): what the routes take, and the hot path in front of them
ANSWERS = {"/v1/chat/completions": (ChatCompletionRequest, chat_answer, "chat"),
           "/v1/completions": (CompletionRequest, completion_answer, "completions")}


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    for path, (model, answer, name) in ANSWERS.items():
        def route(model=model, answer=answer):
            async def handler(request: Request):
                req = await parse(request, model, limits.max_body_bytes)
                return generate_common.respond(await answer(state, req, request.receive))
            return handler

        r.add_api_route(path, route(), methods=["POST"], name=name, openapi_extra=body(model),
                        responses=ANSWER_OR_STREAM)
    return r


def _closer(deltas, agens):
    """EventStream.close: the merge and every service stream (also when the merge never started)."""
    async def close():
        await deltas.aclose()
        for a in agens:
            await a.aclose()
    return close
