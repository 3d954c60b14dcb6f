"""The served OpenAPI document (/openapi.json): request bodies and error responses.

The routes read and validate their bodies themselves (server/http/common.py:
bounded reads, one error format, the hot path), so FastAPI cannot see their
body models. A route declares its body with `openapi_extra=body(Model)`; the
document then names the model's JSON schema (hoisted into
components/schemas), and every operation lists the error responses the server
gives, in the body shape of its protocol (KServe's {"error": "..."} under /v2,
Anthropic's {"type": "error", "error": {...}} under /v1/messages, text-embeddings-inference's
{"error": "...", "error_type": "..."} on its routes (server/tei_errors.py), OpenAI's {"error": {...}} elsewhere). Client generators and fuzzers
(schemathesis, tests/e2e/test_openapi_fuzz.py) read it.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from surge.server.errors import ANTHROPIC_PATHS, is_kserve_path
from surge.server.tei_errors import is_tei_route

JSON = "application/json"
BINARY = "application/octet-stream"
# The content types the KServe binary tensor extension arrives with (tritonclient
# sends application/octet-stream; SageMaker-style clients the vendor type).
BINARY_TYPES = (BINARY, "application/vnd.sagemaker-triton.binary+json")

_MODELS: dict[str, type[BaseModel]] = {}

ERRORS = {
    "400": "Invalid input",
    "401": "Missing or invalid API key",
    "404": "Unknown model, version or pipeline",
    "413": "Request too large",
    "415": "Unsupported content type",
    "422": "Request body does not match the schema",
    "429": "Overloaded: retry after the Retry-After header's seconds",
    "500": "Engine or load failure",
    "503": "Not ready",
    "504": "Timed out",
}

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "string"}},
    }},
}
_KSERVE_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}
_TEI_ERROR = {
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {"error": {"type": "string"}, "error_type": {
        "type": "string", "enum": ["Empty", "Validation", "Tokenizer", "Backend", "Overloaded", "Unhealthy"]}},
}
# TEI answers a route of another task (and a failed inference) as a Backend error
_TEI_ERRORS = {**ERRORS, "424": "Backend error: the model does not serve this route's task, or inference failed"}
_EMPTY = {"type": "object", "maxProperties": 0, "description": "no fields"}


def body(model: type[BaseModel] | None = None, *, required: bool = True, binary: bool = False) -> dict:
    """`openapi_extra` for a route whose JSON body is `model` (None: an empty object)."""
    if model is None:
        schema = _EMPTY
    else:
        _MODELS[model.__name__] = model
        schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    content = {JSON: {"schema": schema}}
    if binary:  # KServe binary tensor extension: a JSON header, then raw tensor bytes
        content[BINARY] = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": required, "content": content}}


def install(app: FastAPI, tei_embed: bool = False) -> None:
    """`tei_embed`: POST /embed answers TEI's errors (--tei-embed)."""
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, model in sorted(_MODELS.items()):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[name] = schema
        schemas["OpenAIError"], schemas["KServeError"] = _OPENAI_ERROR, _KSERVE_ERROR
        schemas["AnthropicError"], schemas["TEIError"] = _ANTHROPIC_ERROR, _TEI_ERROR
        for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's; errors here look like the rest
            schemas.pop(name, None)
        for path, operations in doc.get("paths", {}).items():
            shape = "KServeError" if is_kserve_path(path) else \
                "AnthropicError" if path.startswith(ANTHROPIC_PATHS) else "OpenAIError"
            for method, op in operations.items():
                tei = is_tei_route(path, method.upper(), tei_embed)
                ref = {"$ref": "#/components/schemas/" + ("TEIError" if tei else shape)}
                responses = op.setdefault("responses", {})
                for code, description in (_TEI_ERRORS if tei else ERRORS).items():
                    declared = responses.get(code)
                    if declared is None or code == "422" and "HTTPValidationError" in str(declared):
                        responses[code] = {"description": description, "content": {JSON: {"schema": ref}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
