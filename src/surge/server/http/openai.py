"""OpenAI-compatible embeddings: POST /v1/embeddings, GET /v1/models, GET /v1/models/{id}."""

from __future__ import annotations

import base64
import functools
from typing import Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from surge.errors import EmptyInput, InvalidInput, PayloadTooLarge, shown
from surge.server.http import fail_fast
from surge.runtime.off_loop import prepared
from surge.server.http.common import ORJSONResponse, declared_size, parse
from surge.server.http.openapi import body
from surge.server.http.openai_inputs import check_lengths, check_token_ids
from surge.server.state import AppState
from surge.types import EmbedOptions
from surge.runtime.request import response_headers

TokenIds = fail_fast.items(StrictInt)  # a union's choice: fail_fast.items
_MAX_ID = 2 ** 63 - 1


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Union[StrictStr, fail_fast.items(StrictStr), TokenIds, fail_fast.items(TokenIds)]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None
    truncate: StrictBool | None = Field(None, description="Cut inputs longer than the model (default: the "
                                        "server's --auto-truncate; off: such an input gets 400).")


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
        raise EmptyInput("'input' must not be empty", param="input")
    items = texts if texts is not None else ids
    if len(items) > max_inputs:
        raise PayloadTooLarge(f"'input' has {len(items)} items; at most {max_inputs} are allowed", param="input")
    if texts is not None:
        for i, t in enumerate(texts):
            if not t.strip():
                raise EmptyInput(f"input {i} is an empty string", param="input")
            if len(t) > max_chars:
                raise PayloadTooLarge(f"input {i} has {len(t)} characters; at most {max_chars} are allowed", param="input")
    else:
        for i, seq in enumerate(ids):
            if not seq:
                raise EmptyInput(f"input {i} is an empty token list", param="input")
            # JSON integers are unbounded; the cache key and the engine take int64. The
            # vocabulary bound is the tokenizer's check, this one keeps ids convertible.
            if min(seq) < 0 or max(seq) > _MAX_ID:
                bad = min(seq) if min(seq) < 0 else max(seq)
                raise InvalidInput(f"input {i}: token id {shown(bad)} is out of range (ids are non-negative and "
                                   "below the model's vocabulary size)", param="input")
    return texts, ids


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    @r.post("/v1/embeddings", openapi_extra=body(EmbeddingsRequest))
    async def embeddings(request: Request):
        req = await parse(request, EmbeddingsRequest, limits.max_body_bytes)
        # a large body's thousands of inputs checked off the loop too (its JSON was: common.checked_body)
        texts, ids = await prepared(declared_size(request), split_input, req.input,
                                    limits.max_inputs_per_request, limits.max_input_chars)
        service = state.registry.get(req.model)
        truncate = limits.auto_truncate if req.truncate is None else req.truncate
        check_token_ids(ids, service.name, limits.allow_token_ids, getattr(service, "max_length", None), truncate)
        # Computed truncated whatever was asked (cache keys stay one); too long without truncation: 400 after.
        result = await state.run(service, texts=texts, token_ids=ids, options=EmbedOptions(dimensions=req.dimensions),
                                 check=None if truncate else functools.partial(check_lengths, service, texts))
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
            "model": req.model or service.name,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }
        return ORJSONResponse(body, headers=response_headers(result))

    def model_object(name: str) -> dict:
        service = state.registry.get(name)
        adapter = getattr(service, "adapter", None)
        if adapter is not None:  # a LoRA adapter: vLLM's root (its directory) and parent (the base model)
            return {"id": name, "object": "model", "created": int(service.loaded_at), "owned_by": "surge",
                    "root": str(adapter.path), "parent": service.parent}
        return {"id": name, "object": "model", "created": int(service.loaded_at), "owned_by": "surge",
                "root": service.name}

    @r.get("/v1/models")
    async def models():
        registry = state.registry
        names = registry.names() + sorted(a for a, n in registry.aliases().items() if n in registry.names())
        return ORJSONResponse({"object": "list", "data": [model_object(n) for n in names]})

    @r.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        # The openai client's models.retrieve(id); 404 in OpenAI's error body for an unknown id.
        return ORJSONResponse(model_object(model_id))

    return r
