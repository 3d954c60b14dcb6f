"""surge's native API: POST /embed (texts or token ids in, vectors out)."""

from __future__ import annotations

from typing import Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from surge.server.http import fail_fast
from surge.runtime.off_loop import prepared
from surge.server.http.common import ORJSONResponse, declared_size, parse
from surge.server.http.openapi import body
from surge.server.http.tei import check_direction
from surge.server.http.openai import TokenIds, split_input
from surge.server.state import AppState
from surge.types import EmbedOptions
from surge.runtime.request import response_headers


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: Union[StrictStr, fail_fast.items(StrictStr), TokenIds, fail_fast.items(TokenIds)]
    model: StrictStr | None = None
    version: StrictStr | None = None
    normalize: StrictBool | None = None
    truncate: StrictBool = True
    dimensions: StrictInt | None = Field(None, ge=1)
    # text-embeddings-inference's: a sentence-transformers prompt by name; which end of a too-long input is
    # cut ("right", the default, or "left")
    prompt_name: StrictStr | None = None
    truncation_direction: StrictStr | None = None


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    @r.post("/embed", openapi_extra=body(EmbedRequest))
    async def embed(request: Request):
        req = await parse(request, EmbedRequest, limits.max_body_bytes)
        # a large body's thousands of inputs checked off the loop too (its JSON was: common.checked_body)
        texts, ids = await prepared(declared_size(request), split_input, req.inputs,
                                    limits.max_inputs_per_request, limits.max_input_chars)
        service = state.registry.get(req.model, req.version)
        direction = check_direction(req.truncation_direction)
        normalize = req.normalize
        if normalize is None and state.config.tei_embed:
            normalize = True  # TEI's default, whatever the model's own modules say (surge's: the model's)
        options = EmbedOptions(normalize=normalize, truncate=req.truncate, dimensions=req.dimensions,
                               prompt_name=req.prompt_name, truncation_direction=direction)
        result = await state.run(service, texts=texts, token_ids=ids, options=options)
        if state.config.tei_embed:  # text-embeddings-inference's shape: the bare array of vectors
            return ORJSONResponse(result.vectors, headers={"x-surge-model-version": result.version})
        body = {
            "model": result.model,
            "version": result.version,
            "dimensions": int(result.vectors.shape[1]),
            "embeddings": result.vectors,
            "usage": {"prompt_tokens": result.prompt_tokens},
        }
        return ORJSONResponse(body, headers=response_headers(result))

    return r
