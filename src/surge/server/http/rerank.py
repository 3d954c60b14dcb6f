"""POST /v1/rerank: the rerank API that RAG frameworks call (Cohere / Jina shape).

  {"model", "query", "documents": [str | {"text": str}], "top_n", "return_documents"}
  -> {"id", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}], "usage"}

Results are best first; `top_n` (1..len(documents)) keeps the best N. Scores
are the cross-encoder's sigmoid, as sentence-transformers' CrossEncoder.predict.
"""

from __future__ import annotations

import uuid
from typing import Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from surge.errors import InvalidInput
from surge.runtime.tasks import TaskRequest
from surge.server.http.common import ORJSONResponse, parse
from surge.server.http.task_io import body_schema, check_texts, rerank_scores, run_task
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


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits

    @r.post("/v1/rerank", openapi_extra=body_schema(CohereRerankRequest))
    async def rerank(request: Request):
        req = await parse(request, CohereRerankRequest, limits.max_body_bytes)
        served = state.registry.get(req.model)
        if not req.query.strip():
            raise InvalidInput("'query' must be a non-empty string", param="query")
        docs = []
        for i, d in enumerate(req.documents):
            if isinstance(d, dict):
                if "text" not in d:
                    raise InvalidInput(f"documents[{i}] is an object without 'text'", param="documents")
                d = d["text"]
            docs.append(d)
        check_texts(docs, "documents", limits)
        if req.top_n is not None and not 1 <= req.top_n <= len(docs):
            raise InvalidInput(f"top_n must be between 1 and the number of documents ({len(docs)}), "
                               f"got {req.top_n}", param="top_n")
        result = await run_task(state, served, TaskRequest(pairs=[(req.query, d) for d in docs],
                                                           truncate=req.truncate, param="documents"), "rerank")
        scores = rerank_scores(result)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or len(docs)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
        return ORJSONResponse({"id": str(uuid.uuid4()), "model": served.name, "results": results,
                               "usage": {"total_tokens": result.prompt_tokens},
                               "meta": {"billed_units": {"search_units": 1}}})

    return r
