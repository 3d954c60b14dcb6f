"""text-embeddings-inference's embedding routes beyond /embed (server/http/tei.py has the rest).

POST /similarity    {"inputs": {"source_sentence", "sentences"}, "parameters": {"truncate",
                    "truncation_direction", "prompt_name"}} -> [float], the cosine of each sentence with
                    the source (a reranker: its cross-encoder scores, as POST / answers that shape)
POST /embed_all     {"inputs": str | [str], "truncate", "truncation_direction", "prompt_name"} -> [input][token]
                    [hidden]: the last hidden state of every token (special ones included), neither pooled
                    nor normalized, as TEI's. Admitted as /embed is (429), and held under admission until the
                    kernel has taken the answer's last byte (server/http/held_answer.py), 413 past --max-token-states-bytes,
                    computed outside the dynamic batcher and the cache (runtime/token_states.py), in this
                    process or the engine process (--workers); TEI's Backend error (424) only where the
                    engines have no hidden state to return (they pool or run heads inside their graph).
POST /embed_sparse  TEI answers it for SPLADE models only; surge serves none, so it answers what TEI
                    answers any other model: 424 {"error": "Model is not an embedding model with SPLADE
                    pooling", "error_type": "Backend"}, after checking the body as TEI does.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Union

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from surge.engines.pooling import l2_normalize
from surge.errors import EmptyInput, InvalidInput, Unsupported
from surge.runtime.tasks import TaskRequest, require_task
from surge.server.http.common import ORJSONResponse, parse
from surge.server.http.held_answer import HeldAnswer
from surge.server.http.task_io import body_schema, check_length, check_texts, rerank_scores, run_task
from surge.server.state import AppState
from surge.types import EmbedOptions

# TEI's own wording of what it answers on a model without a SPLADE head (core/src/infer.rs)
NOT_SPLADE = "Model is not an embedding model with SPLADE pooling"
# What a bad `inputs` is told (server/http/common.validate) on the TEI routes that take texts only, where
# the embeddings routes' hint offers token ids too
TEXTS_HINT = "expected a string or a list of strings (texts, not token ids)"


class NotSplade(Unsupported):
    """TEI renders this one as a Backend error (424), as it does the same refusal."""


class SimilarityRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inputs: dict[str, Any]
    parameters: dict[str, Any] | None = None
    model: StrictStr | None = None


class TokensRequest(BaseModel):
    """TEI's EmbedSparseRequest and EmbedAllRequest: /embed's body without normalize / dimensions."""

    model_config = ConfigDict(extra="forbid")
    union_hints: ClassVar[dict] = {"inputs": TEXTS_HINT}
    inputs: Union[StrictStr, list[StrictStr]]
    truncate: StrictBool | None = None
    truncation_direction: StrictStr | None = None
    prompt_name: StrictStr | None = None
    model: StrictStr | None = None


# TEI's TruncationDirection (router/src/http/types.rs, v1.9): its variants and their lowercase aliases
_DIRECTIONS = {None: "right", "right": "right", "Right": "right", "left": "left", "Left": "left"}


def check_direction(value) -> str:
    """TEI's `truncation_direction` as "right" (its default) or "left" (a too-long input keeps its last
    tokens); any other value is TEI's validation error."""
    try:
        return _DIRECTIONS[value]
    except (KeyError, TypeError):  # TypeError: a list or an object is no key
        raise InvalidInput("truncation_direction must be 'left' or 'right' (or 'Left', 'Right')",
                           param="truncation_direction") from None


async def similarity(state: AppState, served, inputs: dict, truncate: bool, prompt_name: str | None = None,
                     empty_message: str | None = None, direction: str = "right") -> list[float]:
    """Cosine of each of inputs["sentences"] with inputs["source_sentence"] (a reranker: its scores).
    `empty_message`: what an empty `sentences` is answered with (TEI's own wording on /similarity);
    `direction`: check_direction's."""
    limits = state.config.limits
    source, others = inputs.get("source_sentence"), inputs.get("sentences")
    if not isinstance(source, str):
        raise InvalidInput("inputs.source_sentence must be a string", param="source_sentence")
    if not source.strip():
        raise EmptyInput("inputs.source_sentence must not be empty", param="source_sentence")
    check_length(source, "source_sentence", limits)
    if not isinstance(others, list):
        raise InvalidInput("inputs.sentences must be a list of strings", param="sentences")
    if not others and empty_message:
        raise EmptyInput(empty_message, param="sentences")
    check_texts(others, "sentences", limits)
    if getattr(served, "task", "embed") == "rerank":
        result = await run_task(state, served, TaskRequest(pairs=[(source, s) for s in others], truncate=truncate,
                                                           param="sentences", truncation_direction=direction),
                                "rerank")
        return rerank_scores(result)
    result = await state.run(served, texts=[source] + others,
                             options=EmbedOptions(normalize=True, truncate=truncate, prompt_name=prompt_name,
                                                  truncation_direction=direction))
    v = l2_normalize(result.vectors.astype(np.float64))
    return [float(x) for x in v[1:] @ v[0]]


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    @r.post("/similarity", openapi_extra=body_schema(SimilarityRequest))
    async def similarity_route(request: Request):
        req = await parse(request, SimilarityRequest, limits.max_body_bytes)
        served = state.registry.get(req.model)
        params = req.parameters or {}
        extra = set(params) - {"truncate", "truncation_direction", "prompt_name"}
        if extra:
            raise InvalidInput(f"unknown parameters {sorted(extra)}", param="parameters")
        truncate = params.get("truncate")
        if truncate is None:
            truncate = True  # TEI's --auto-truncate default (v1.9.0 on)
        if not isinstance(truncate, bool):
            raise InvalidInput("parameters.truncate must be true or false", param="truncate")
        prompt_name = params.get("prompt_name")
        if prompt_name is not None and not isinstance(prompt_name, str):
            raise InvalidInput("parameters.prompt_name must be a string", param="prompt_name")
        direction = check_direction(params.get("truncation_direction"))
        return ORJSONResponse(await similarity(state, served, req.inputs, truncate, prompt_name,
                                               empty_message="`inputs.sentences` cannot be empty",
                                               direction=direction))

    @r.post("/embed_all", openapi_extra=body_schema(TokensRequest))
    async def embed_all(request: Request):
        req = await parse(request, TokensRequest, limits.max_body_bytes)
        served = state.registry.get(req.model)
        left = check_direction(req.truncation_direction) == "left"
        texts = check_texts([req.inputs] if isinstance(req.inputs, str) else req.inputs, "inputs", limits)
        require_task(served, "embed")
        if not getattr(served, "can_return_tokens", False):
            raise Unsupported(f"model '{served.name}' has no per-token hidden state to return (its engines pool "
                              "or run heads inside their graph)", param="model")
        truncate = True if req.truncate is None else req.truncate  # TEI's --auto-truncate default
        # The answer is held under its admission slot until the kernel has taken its last byte (HeldAnswer
        # closes `held`): what slow readers hold is bounded as the compute is. Through state.call, as every
        # model call, for the KServe statistics; on the copy that serves now (a reload between the lookup and
        # the call: the new one answers). An answer cut before the kernel took its last byte (the client gone,
        # or cut by --send-timeout-s with its tail in the server's buffers) ends the block with its error:
        # counted as a failure under its code, not answered.
        held = contextlib.AsyncExitStack()

        async def release(error):
            if error is None:
                await held.aclose()
            else:
                await held.__aexit__(type(error), error, error.__traceback__)

        try:
            answer = await state.call(served, lambda deadline: state.on_current(
                served, lambda s: held.enter_async_context(s.held_token_states(texts, truncate, left,
                                                                                 req.prompt_name, deadline))))
            return HeldAnswer(answer.vectors, release)
        except BaseException:
            await held.aclose()
            raise

    @r.post("/embed_sparse", openapi_extra=body_schema(TokensRequest))
    async def embed_sparse(request: Request):
        req = await parse(request, TokensRequest, limits.max_body_bytes)
        state.registry.get(req.model)  # an unknown model is still a 404
        check_direction(req.truncation_direction)
        check_texts([req.inputs] if isinstance(req.inputs, str) else req.inputs, "inputs", limits)
        raise NotSplade(NOT_SPLADE, param="model")

    return r
