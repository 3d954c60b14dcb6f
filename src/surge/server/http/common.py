"""What every HTTP route shares: bounded body reading, strict JSON decoding,
schema validation with clear messages, and JSON responses via orjson."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from surge.errors import BodyTooLarge, InvalidInput, Unprocessable, shown
from surge.json_depth import check_body
from surge.runtime.off_loop import prepared
from surge.server.http import fail_fast

M = TypeVar("M", bound=BaseModel)

PARSED_BODY = "surge.parsed_body"  # request.state key: JSON the hot-path layer already decoded

_INPUT_HINT = "expected a string, a list of strings, a list of token ids, or a list of token-id lists"
UNION_HINTS = {"input": _INPUT_HINT, "inputs": _INPUT_HINT}


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than `limit` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise BodyTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        except ValueError:
            raise InvalidInput("invalid Content-Length header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(body: bytes):
    if not body:
        raise InvalidInput("request body is empty; expected a JSON object")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"request body is not valid UTF-8 (byte {exc.start})") from None
    fail_fast.BODY_SIZE.set(len(body))
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    check_body(body, data)  # deeper than later code can recurse through: 400 here, not a 500 there
    return data


def validate(model: type[M], data) -> M:
    if not isinstance(data, dict):
        raise InvalidInput("request body must be a JSON object")
    known = fail_fast.known_keys(model)
    if known is not None:  # one error for the first unknown key, not one per key (server/http/fail_fast.py)
        unknown = next((k for k in data if k not in known), None)
        if unknown is not None:
            # pydantic names a missing required field before an unknown key: the more useful of the two
            missing = fail_fast.first_missing(model, data)
            if missing is not None:
                raise Unprocessable(f"missing required field '{shown(missing)}'", param=shown(missing))
            raise Unprocessable(f"unknown field '{shown(unknown)}'", param=shown(unknown))
    try:
        fail_fast.check(model, data)  # a large body: its first error found without collecting them all
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        field = shown(first["loc"][0]) if first.get("loc") else "body"
        hints = getattr(model, "union_hints", UNION_HINTS)  # a model whose `input` is not the embeddings' names its own
        if field in hints and any(len(e.get("loc", ())) > 1 for e in errors):
            # A union's errors list every alternative; one plain sentence helps more.
            raise Unprocessable(f"invalid field '{field}': {hints[field]}", param=field) from None
        if first.get("type") == "missing":
            raise Unprocessable(f"missing required field '{field}'", param=field) from None
        if first.get("type") == "extra_forbidden":
            raise Unprocessable(f"unknown field '{field}'", param=field) from None
        where = shown(".".join(str(p) for p in first.get("loc", ()))) or "body"
        raise Unprocessable(f"invalid field '{where}': {first.get('msg')}", param=field) from None


async def parse(request: Request, model: type[M], limit: int) -> M:
    return await checked_body(request, functools.partial(validate, model), limit)


async def checked_body(request: Request, check: Callable, limit: int):
    """`check(the decoded JSON body)`: a large body is decoded and checked on a preparation thread
    (runtime/off_loop.py), not on the event loop."""
    parsed = request.scope.get("state", {}).get(PARSED_BODY)
    if parsed is not None:  # a hot path's (declared length): a large one is checked off the loop too
        return await prepared(declared_size(request), check, parsed)
    body = await read_body(request, limit)
    fail_fast.BODY_SIZE.set(len(body))  # this task's (decode_json sets it in the thread's copy of the context)
    return await prepared(len(body), checked_json, check, body)


def declared_size(request: Request) -> int | None:
    """The body's size its Content-Length declares (None: not declared or not a number)."""
    try:
        return int(request.headers["content-length"])
    except (KeyError, ValueError):
        return None


def checked_json(check: Callable, body: bytes):
    """`check(body decoded)`."""
    return check(decode_json(body))


async def json_body(request: Request, limit: int):
    """The request's decoded JSON body (for a route whose body shape picks the model to validate with); a large
    body decoded on a preparation thread, as checked_body's (orjson only decodes valid UTF-8 JSON, so a body the
    hot path parsed needs no second look)."""
    return await checked_body(request, _as_is, limit)


def _as_is(data):
    return data
