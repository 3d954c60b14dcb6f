"""The generate extension of KServe / Triton: POST /v2/models/{m}[/versions/{v}]/generate and
generate_stream.

Body: {"text_input": "...", "parameters": {"max_tokens": 32, "temperature": 0, ...}}; the
parameters may also be given at the top level (Triton maps every JSON key to an input).
Answer: {"model_name", "model_version", "text_output", "finish_reason", "prompt_tokens",
"completion_tokens"}; generate_stream sends one such event per delta (server-sent events,
`text_output` holding the delta), the last one with finish_reason. Errors: {"error": msg}.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from surge.server.http.common import ORJSONResponse, parse
from surge.server.http.generate_common import (EventStream, counted, counted_stream, deadline_for, generate_model,
                                               make_params, sse, sse_response, until_disconnect)
from surge.server.http.openapi import body
from surge.server.state import AppState


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = Field(None, ge=1)
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


class GenerateRequest(GenerateParameters):
    text_input: StrictStr = Field(..., min_length=1)
    id: StrictStr | None = None
    parameters: GenerateParameters | None = None


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    async def _prepare(request: Request, name: str, version: str | None):
        req = await parse(request, GenerateRequest, limits.max_body_bytes)
        service = generate_model(state, name, version)
        top = req.model_dump(exclude={"text_input", "id", "parameters"}, exclude_unset=True)
        nested = req.parameters.model_dump(exclude_unset=True) if req.parameters else {}
        p = {**top, **nested}
        params = make_params(service, max_tokens=p.get("max_tokens"), temperature=p.get("temperature"),
                             top_p=p.get("top_p"), top_k=p.get("top_k"), min_p=p.get("min_p"), seed=p.get("seed"),
                             stop=p.get("stop"), stop_token_ids=p.get("stop_token_ids"),
                             presence_penalty=p.get("presence_penalty"), frequency_penalty=p.get("frequency_penalty"),
                             repetition_penalty=p.get("repetition_penalty"), ignore_eos=p.get("ignore_eos"))
        ids = service.encode(req.text_input)
        service.check_prompt(ids)
        return req, service, ids, params

    def _body(req, service, text, finish, prompt, completion) -> dict:
        body = {"model_name": service.name, "model_version": service.version, "text_output": text,
                "finish_reason": finish, "prompt_tokens": prompt, "completion_tokens": completion}
        if req.id is not None:
            body["id"] = req.id
        return body

    async def generate(request: Request, name: str, version: str | None = None):
        req, service, ids, params = await _prepare(request, name, version)
        res = await until_disconnect(request.receive, counted(state, service,
                                                      service.generate(ids, params, deadline=deadline_for(state))))
        return ORJSONResponse(_body(req, service, res.text, res.finish_reason, res.prompt_tokens,
                                    res.completion_tokens))

    async def generate_stream(request: Request, name: str, version: str | None = None):
        req, service, ids, params = await _prepare(request, name, version)
        agen = counted_stream(state, service, service.stream(ids, params, deadline=deadline_for(state)))
        first = await agen.__anext__()

        async def rest():
            d = first
            try:
                while True:
                    if d.text or d.finish_reason is not None:
                        yield sse(_body(req, service, d.text, d.finish_reason, d.prompt_tokens, d.completion_tokens))
                    if d.finish_reason is not None:
                        return
                    d = await agen.__anext__()
            finally:
                await agen.aclose()

        return sse_response(EventStream(rest(), lambda exc: {"error": exc.message}, done=False))

    extra = body(GenerateRequest)
    events = {200: {"description": "One server-sent event per delta",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        r.add_api_route(base + "/generate", generate, methods=["POST"], openapi_extra=extra)
        r.add_api_route(base + "/generate_stream", generate_stream, methods=["POST"], openapi_extra=extra,
                        responses=events)
    return r
