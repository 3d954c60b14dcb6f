"""text-embeddings-inference's error answers on its routes.

TEI (router/src/http/server.rs, v1.9.3) answers every error as `{"error": str, "error_type": T}`
with the status its error type gives: Empty 400, Validation and Tokenizer 422 (413 before v1.9.0),
Backend 424, Overloaded 429, Unhealthy 503. Its clients read that string (huggingface_hub puts
`error` into the exception's message; a nested object came out as a Python repr), so the TEI and
Hugging Face Inference routes answer this shape and these statuses, the other protocols their own.
"""

from __future__ import annotations

from surge.errors import (BodyTooLarge, EmptyInput, EngineError, InvalidInput, NotReady, Overloaded, PayloadTooLarge,
                          ResultTooLarge, SurgeError, Unprocessable, Unsupported, WrongTask)

# TEI's own paths (GET /info included) and surge's TEI-only additions; POST /embed is TEI's only under
# --tei-embed (surge's native object otherwise), POST /models/{name} is HF Inference's (TEI's shape).
TEI_PATHS = frozenset({"/", "/predict", "/rerank", "/tokenize", "/decode", "/info", "/similarity", "/embed_all",
                       "/embed_sparse"})
_BY_STATUS = {424: "Backend", 429: "Overloaded", 503: "Unhealthy"}


def is_tei_route(path: str, method: str = "POST", tei_embed: bool = False) -> bool:
    if path in TEI_PATHS:
        return True
    if path == "/embed":
        return tei_embed
    # GET /models/{name} and /models/{name}/load are surge's lifecycle, not HF Inference's
    return method == "POST" and path.startswith("/models/") and len(path) > 8 and "/" not in path[8:]


def tei_status(exc: SurgeError) -> tuple[int, str]:
    """(HTTP status, TEI error type) of a surge error, as TEI answers the same failure."""
    if isinstance(exc, EmptyInput):
        return 400, "Empty"
    if isinstance(exc, WrongTask):  # TEI: "model is not a re-ranker model", a backend error
        return 424, "Backend"
    if isinstance(exc, (BodyTooLarge, ResultTooLarge)):  # TEI's body limit (axum) answers 413
        return 413, "Validation"
    if isinstance(exc, (InvalidInput, PayloadTooLarge, Unprocessable)):  # too many / too long inputs included
        return 422, "Validation"
    if isinstance(exc, Overloaded):
        return 429, "Overloaded"
    if isinstance(exc, NotReady):
        return 503, "Unhealthy"
    if isinstance(exc, (EngineError, Unsupported)):
        return 424, "Backend"
    return exc.http_status, type_of(exc.http_status)


def type_of(status: int) -> str:
    """TEI's error type of a status surge answers for its own reasons (401, 404, 405, 415, 504, 500)."""
    return _BY_STATUS.get(status, "Backend" if status >= 500 else "Validation")
