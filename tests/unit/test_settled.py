"""server.errors.settled: the one place the hot paths (ASGI and direct) turn a request's failure into the
routes' answer. Its docstring's contract, case by case."""

from __future__ import annotations

import asyncio
import logging
import random

import orjson
import pytest

from surge.errors import DeadlineExceeded, EmptyInput, Overloaded, PayloadTooLarge, SurgeError, WrongTask
from surge.server.errors import settled


async def _returns(value):
    await asyncio.sleep(0)
    return value


async def _raises(exc):
    await asyncio.sleep(0)
    raise exc


def test_a_result_comes_back_untouched():
    value = [random.random() for _ in range(5)]
    result, error = asyncio.run(settled("/embed", _returns(value)))
    assert result is value and error is None


@pytest.mark.parametrize("path,exc,status,body", [
    ("/v1/embeddings", Overloaded("queue full", retry_after=2.4), 429,
     {"error": {"message": "queue full", "type": "rate_limit_error", "param": None, "code": "overloaded"}}),
    ("/v2/models/m/infer", DeadlineExceeded("too slow"), 504, {"error": "too slow"}),
    # text-embeddings-inference's routes: its {"error", "error_type"} and its status for the type
    ("/predict", Overloaded("queue full", retry_after=2.4), 429, {"error": "queue full", "error_type": "Overloaded"}),
    ("/rerank", WrongTask("model 'e' serves task 'embed', not 'rerank'"), 424,
     {"error": "model 'e' serves task 'embed', not 'rerank'", "error_type": "Backend"}),
    ("/", EmptyInput("'inputs' must not be empty"), 400, {"error": "'inputs' must not be empty", "error_type": "Empty"}),
    ("/models/m", PayloadTooLarge("input 0 has 600 tokens"), 422,
     {"error": "input 0 has 600 tokens", "error_type": "Validation"}),
])
def test_a_surge_error_is_rendered_as_the_routes_render_it(path, exc, status, body):
    result, error = asyncio.run(settled(path, _raises(exc)))
    assert result is None
    assert error.status_code == status and orjson.loads(error.body) == body
    if exc.retry_after is not None:
        assert error.headers["retry-after"] == "2"


def test_any_other_exception_is_the_catch_alls_500_and_is_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="surge.server"):
        result, error = asyncio.run(settled("/predict", _raises(KeyError("boom"))))
    assert result is None and error.status_code == 500
    assert orjson.loads(error.body) == {"error": "internal server error", "error_type": "Backend"}  # TEI's shape
    [record] = [r for r in caplog.records if "unhandled error on /predict" in r.getMessage()]
    assert record.exc_info and record.exc_info[0] is KeyError  # the traceback is kept


def test_cancellation_is_not_caught():
    async def main():
        task = asyncio.ensure_future(settled("/embed", asyncio.sleep(10)))
        await asyncio.sleep(0)
        task.cancel()
        return await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def _every_error_class(cls=SurgeError):
    for sub in cls.__subclasses__():
        yield sub
        yield from _every_error_class(sub)


def test_openai_error_type_follows_the_status_of_every_error_class():
    """A 4xx (ConfigError's 400, say) is the client's error in OpenAI's body, never server_error; 429 is
    rate_limit_error, 504 timeout; a 5xx other than those server_error (Unsupported's 501: the request's)."""
    import importlib

    for module in ("surge.optimize.pipeline", "surge.server.http.responses_api", "surge.server.http.tei_embeddings"):
        importlib.import_module(module)  # their SurgeError classes (GateFailed, ResponseNotFound, NotSplade)

    classes = list(_every_error_class())
    assert len(classes) > 10
    for cls in classes:
        status, exc = cls.http_status, cls.__new__(cls)
        SurgeError.__init__(exc, "boom")  # (GateFailed's own __init__ takes more)
        _, response = asyncio.run(settled("/v1/embeddings", _raises(exc)))
        body = orjson.loads(response.body)["error"] if response.status_code == status else None
        assert body is not None, cls
        want = {429: "rate_limit_error", 504: "timeout", 501: "invalid_request_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        assert body["type"] == want, (cls, status, body)
