"""POST /v1/rerank (and /v2/rerank; /rerank with this body): the rerank API that RAG frameworks call
(Cohere / Jina shape).

  {"model", "query", "documents": [str | {"text": str}], "top_n", "return_documents"}
  -> {"id", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}], "usage"}

Results are best first; `top_n` (a positive integer) keeps the best N, all of them when there are
no more than N, as Cohere answers (LangChain's CohereRerank asks for its default top_n=3 whatever
the number of documents it was given) and as vLLM does. `top_n: 0` is every document, as vLLM reads
it (0 is its default) and Jina documents an absent top_n; Cohere documents top_n >= 1 and refuses 0,
so no client written for Cohere sends it, while clients written for vLLM, or that serialize an unset
integer as 0, do. Scores are the cross-encoder's
sigmoid, as sentence-transformers' CrossEncoder.predict.
"""

from __future__ import annotations

import uuid
from typing import Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from surge.errors import InvalidInput
from surge.runtime.tasks import TaskRequest
from surge.server.http.common import ORJSONResponse, parse
from surge.server.http.task_io import body_schema, check_length, check_texts, rerank_scores, run_task
from surge.server.state import AppState


class CohereRerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: StrictStr
    documents: list[Union[StrictStr, dict[str, StrictStr]]]
    model: StrictStr | None = None
    top_n: StrictInt | None = None
    return_documents: StrictBool = False
    max_chunks_per_doc: StrictInt | None = None  # Cohere v1 field: accepted, documents are never chunked
    truncate: StrictBool = True


def is_cohere_body(body) -> bool:
    """A Cohere / Jina body (`documents`) rather than TEI's (`texts`): what vLLM's POST /rerank takes, so
    server/http/tei.py's /rerank hands it here."""
    return isinstance(body, dict) and "documents" in body and "texts" not in body


async def answer(state: AppState, req: CohereRerankRequest) -> ORJSONResponse:
    limits = state.config.limits
    served = state.registry.get(req.model)
    if not req.query.strip():
        raise InvalidInput("'query' must be a non-empty string", param="query")
    check_length(req.query, "query", limits)
    docs = []
    for i, d in enumerate(req.documents):
        if isinstance(d, dict):
            if "text" not in d:
                raise InvalidInput(f"documents[{i}] is an object without 'text'", param="documents")
            d = d["text"]
        docs.append(d)
    check_texts(docs, "documents", limits)
    if req.top_n is not None and req.top_n < 0:
        raise InvalidInput(f"top_n must be 0 (every document) or a positive integer, got {req.top_n}",
                           param="top_n")
    result = await run_task(state, served, TaskRequest(pairs=[(req.query, d) for d in docs],
                                                       truncate=req.truncate, param="documents"), "rerank")
    scores = rerank_scores(result)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or len(docs)]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
    return ORJSONResponse({"id": str(uuid.uuid4()), "model": served.name, "results": results,
                           "usage": {"total_tokens": result.prompt_tokens},
                           "meta": {"billed_units": {"search_units": 1}}})


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    # /v2/rerank: Cohere's v2 path (its ClientV2.rerank), which vLLM serves too
    @r.post("/v1/rerank", openapi_extra=body_schema(CohereRerankRequest))
    @r.post("/v2/rerank", openapi_extra=body_schema(CohereRerankRequest))
    async def rerank(request: Request):
        return await answer(state, await parse(request, CohereRerankRequest, limits.max_body_bytes))

    return r
