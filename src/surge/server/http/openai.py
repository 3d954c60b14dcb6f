"""OpenAI-compatible embeddings: POST /v1/embeddings, GET /v1/models."""

from __future__ import annotations

import base64
from typing import Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from surge.errors import InvalidInput, PayloadTooLarge
from surge.server.http.common import ORJSONResponse, parse
from surge.server.state import AppState
from surge.types import EmbedOptions
from surge.runtime.request import response_headers

TokenIds = list[StrictInt]


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None


def split_input(raw, max_inputs: int, max_chars: int) -> tuple[list[str] | None, list[list[int]] | None]:
    """Normalize OpenAI's four input shapes into texts or token-id lists."""
    if isinstance(raw, str):
        texts, ids = [raw], None
    elif raw and all(isinstance(x, int) for x in raw):
        texts, ids = None, [raw]
    elif raw and all(isinstance(x, str) for x in raw):
        texts, ids = list(raw), None
    elif raw and all(isinstance(x, list) for x in raw):
        texts, ids = None, list(raw)
    else:
        raise InvalidInput("'input' must not be empty", param="input")
    items = texts if texts is not None else ids
    if len(items) > max_inputs:
        raise PayloadTooLarge(f"'input' has {len(items)} items; at most {max_inputs} are allowed", param="input")
    if texts is not None:
        for i, t in enumerate(texts):
            if not t.strip():
                raise InvalidInput(f"input {i} is an empty string", param="input")
            if len(t) > max_chars:
                raise PayloadTooLarge(f"input {i} has {len(t)} characters; at most {max_chars} are allowed", param="input")
    else:
        for i, seq in enumerate(ids):
            if not seq:
                raise InvalidInput(f"input {i} is an empty token list", param="input")
    return texts, ids


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    @r.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = await parse(request, EmbeddingsRequest, limits.max_body_bytes)
        texts, ids = split_input(req.input, limits.max_inputs_per_request, limits.max_input_chars)
        service = state.registry.get(req.model)
        result = await state.run(service, texts=texts, token_ids=ids, options=EmbedOptions(dimensions=req.dimensions))
        if req.encoding_format == "base64":
            data = [
                {"object": "embedding", "index": i, "embedding": base64.b64encode(row.tobytes()).decode()}
                for i, row in enumerate(result.vectors)
            ]
        else:
            data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(result.vectors)]
        body = {
            "object": "list",
            "data": data,
            "model": service.name,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }
        return ORJSONResponse(body, headers=response_headers(result))

    @r.get("/v1/models")
    async def models():
        data = [
            {"id": name, "object": "model", "created": int(state.registry.get(name).loaded_at), "owned_by": "surge"}
            for name in state.registry.names()
        ]
        return ORJSONResponse({"object": "list", "data": data})

    return r
