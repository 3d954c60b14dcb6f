"""The generate extension of KServe / Triton: POST /v2/models/{m}[/versions/{v}]/generate and
generate_stream.

Body: {"text_input": "...", "parameters": {"max_tokens": 32, "temperature": 0, ...}}; the
parameters may also be given at the top level (Triton maps every JSON key to an input), and include
the structured-output fields of the OpenAI routes (guided_json, guided_regex, guided_choice,
guided_grammar, structured_outputs, response_format) and their vLLM sampling extras (min_tokens,
allowed_token_ids, bad_words, include_stop_str_in_output, skip_special_tokens) and `priority` (under the
model's priority scheduling policy).
Answer: {"model_name", "model_version", "text_output", "finish_reason", "prompt_tokens",
"completion_tokens"}; generate_stream sends one such event per delta (server-sent events,
`text_output` holding the delta), the last one with finish_reason.

Triton's vLLM-backend flags (server/kserve_generate_outputs.py), at either level: the return_* flags add
their outputs (cumulative_logprob, logprobs, num_input_tokens, num_output_tokens) to each answer or event;
`logprobs` (vLLM's sampling parameter) sets the top tokens that `logprobs` lists; `n` must be 1.
exclude_input_in_output: Triton's vLLM backend puts the prompt before the completion unless it is true;
surge's generate answered the completion alone before it took the flag, and its clients read it so, so
here the prompt comes only with exclude_input_in_output false (/infer follows the backend's default).

Errors: {"error": msg}, 400 for any bad input (Triton's one status for it, as /infer), not the 422 of the
OpenAI routes.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from surge.errors import InvalidInput, Unprocessable
from surge.server.http.common import checked_body, validate
from surge.server.http import generate_common
from surge.server.http.generate_common import (SAMPLING_FIELDS, EventStream, JsonAnswer, counted, counted_stream,
                                               deadline_for, generate_model, make_params, prep_size, sse,
                                               until_disconnect)
from surge.runtime.off_loop import prepared
from surge.server.http.guided_fields import asks_guide, guide_from_dict
from surge.server.http.openapi import body
from surge.server.kserve_generate_outputs import STREAM_PROMPT_ERROR, Extras, check_n, logprobs_wanted
from surge.server.state import AppState


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    logit_bias: dict[StrictStr, float] | None = None  # OpenAI's: token id (a string) -> bias, as /v1/completions
    # vLLM's sampling extras, as on the OpenAI routes
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: StrictInt | None = None  # vLLM's, under the model's priority scheduling policy
    # structured outputs, the OpenAI routes' names (server/http/guided_fields.py)
    response_format: dict | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: dict | None = None
    # Triton's vLLM backend (server/kserve_generate_outputs.py)
    logprobs: int | None = Field(None, ge=0, le=20)
    n: StrictInt | None = None
    exclude_input_in_output: StrictBool | None = None
    return_finish_reason: StrictBool | None = None
    return_cumulative_logprob: StrictBool | None = None
    return_logprobs: StrictBool | None = None
    return_num_input_tokens: StrictBool | None = None
    return_num_output_tokens: StrictBool | None = None


FLAG_FIELDS = ("exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob", "return_logprobs",
               "return_num_input_tokens", "return_num_output_tokens")


class GenerateRequest(GenerateParameters):
    text_input: StrictStr = Field(..., min_length=1)
    id: StrictStr | None = None
    parameters: GenerateParameters | None = None


def validated(data) -> GenerateRequest:
    """The request body checked: a schema error is a 400 here, as Triton answers any bad input (the shared
    `validate` says 422, the OpenAI routes' status)."""
    try:
        return validate(GenerateRequest, data)
    except Unprocessable as exc:
        raise InvalidInput(exc.message, param=exc.param) from None


def _body(req, service, text, finish, prompt, completion, extras: dict) -> dict:
    body = {"model_name": service.name, "model_version": service.version, "text_output": text,
            "finish_reason": finish, "prompt_tokens": prompt, "completion_tokens": completion, **extras}
    if req.id is not None:
        body["id"] = req.id
    return body


def _size(req: GenerateRequest) -> int | None:
    """Where the request is prepared (generate_common.prep_size): its structured output may be at either level."""
    return prep_size(guided=asks_guide(req) or (req.parameters is not None and asks_guide(req.parameters)))


def _prepare(state, req: GenerateRequest, name: str, version: str | None, stream: bool):
    """(service, prompt ids, params, Triton's flags): the work that grows with the request (tokenization, bad
    words, guide), on a thread for a large one (runtime/off_loop.py)."""
    service = generate_model(state, name, version)
    top = req.model_dump(exclude={"text_input", "id", "parameters"}, exclude_unset=True)
    nested = req.parameters.model_dump(exclude_unset=True) if req.parameters else {}
    p = {**top, **nested}
    check_n(p.get("n"))
    flags = {k: p[k] for k in FLAG_FIELDS if p.get(k) is not None}
    if stream and flags.get("exclude_input_in_output") is False:
        raise InvalidInput(STREAM_PROMPT_ERROR, param="exclude_input_in_output")
    params = make_params(service, **{k: p.get(k) for k in SAMPLING_FIELDS}, guide=guide_from_dict(p, service),
                         logprobs=logprobs_wanted(flags, p.get("logprobs")))
    ids = service.encode(req.text_input)
    service.check_prompt(ids)
    return service, ids, params, flags


async def generate_answer(state: AppState, req: GenerateRequest, name: str, version: str | None,
                          receive) -> JsonAnswer:
    """The answer to a validated generate request (the route and server/http/generate_hotpath.py)."""
    service, ids, params, flags = await prepared(_size(req), _prepare, state, req, name, version, False)
    res = await until_disconnect(receive, counted(state, service,
                                                  service.generate(ids, params, deadline=deadline_for(state))))
    text = req.text_input + res.text if flags.get("exclude_input_in_output") is False else res.text
    extras = Extras(flags).values(res.logprobs, res.completion_tokens, res.finish_reason, res.prompt_tokens)
    return JsonAnswer(_body(req, service, text, res.finish_reason, res.prompt_tokens, res.completion_tokens,
                            extras), {})


async def generate_stream_answer(state: AppState, req: GenerateRequest, name: str, version: str | None,
                                 receive) -> EventStream:
    """The event stream of a validated generate_stream request; as `generate_answer`."""
    service, ids, params, flags = await prepared(_size(req), _prepare, state, req, name, version, True)
    extras = Extras(flags)
    agen = counted_stream(state, service, service.stream(ids, params, deadline=deadline_for(state)))
    first = await agen.__anext__()

    async def rest():
        d = first
        try:
            while True:
                if d.text or d.finish_reason is not None:
                    more = extras.values(d.logprobs, len(d.token_ids), d.finish_reason, d.prompt_tokens)
                    yield sse(_body(req, service, d.text, d.finish_reason, d.prompt_tokens, d.completion_tokens,
                                    more))
                if d.finish_reason is not None:
                    return
                d = await agen.__anext__()
        finally:
            await agen.aclose()

    return EventStream(rest(), lambda exc: {"error": exc.message}, done=False)


ANSWERS = {"generate": generate_answer, "generate_stream": generate_stream_answer}


def target(path: str) -> tuple[str, str | None, str] | None:
    """(model, version or None, "generate" | "generate_stream") of a generate extension path, else None."""
    parts = path.split("/")
    if len(parts) == 5 and parts[:3] == ["", "v2", "models"] and parts[4] in ANSWERS and parts[3]:
        return parts[3], None, parts[4]
    if (len(parts) == 7 and parts[:3] == ["", "v2", "models"] and parts[4] == "versions" and parts[6] in ANSWERS
            and parts[3] and parts[5]):
        return parts[3], parts[5], parts[6]
    return None


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    def route(answer):
        async def handler(request: Request, name: str, version: str | None = None):
            req = await checked_body(request, validated, limits.max_body_bytes)
            return generate_common.respond(await answer(state, req, name, version, request.receive))
        return handler

    generate, generate_stream = route(generate_answer), route(generate_stream_answer)
    extra = body(GenerateRequest)
    events = {200: {"description": "One server-sent event per delta",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        r.add_api_route(base + "/generate", generate, methods=["POST"], name="generate", openapi_extra=extra)
        r.add_api_route(base + "/generate_stream", generate_stream, methods=["POST"], name="generate_stream",
                        openapi_extra=extra, responses=events)
    return r
