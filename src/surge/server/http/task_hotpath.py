"""A pure-ASGI layer in front of POST /predict: plain classification requests skip the framework.

The classifier's common request is one short command, `{"inputs": "turn off the
lights"}`. FastAPI's request parsing, pydantic validation and response machinery
cost about as much CPU per request as the batched bf16 / INT8 compute of that
command on this project's 2-core machine (measured: ~2.7 ms of server CPU per
request end to end, ~1.2 ms of it the engine). So, as server/http/hotpath.py
does for the embedding routes, a POST /predict whose body is a plain, valid
request (texts only, default options, a classify model) is answered here with
the JSON the route would produce, through the same runtime call
(`task_io.run_task`: timeout, statistics, the cache stage) and the same error
rendering. Anything else (pairs, options, invalid input, another task) goes to
the route unchanged, which owns validation and its error messages; the body it
reads is the one already received (and decoded: PARSED_BODY).
"""

from __future__ import annotations

import orjson

from surge.errors import SurgeError
from surge.runtime.tasks import TaskRequest
from surge.server.errors import settled
from surge.server.http.common import PARSED_BODY
from surge.server.http.hotpath import GONE, HOT_MAX_BYTES, read_declared_body, run_watched
from surge.server.http.task_io import label_scores, run_task

_PATH = "/predict"
_KEYS = frozenset({"inputs", "model"})


class TaskHotPathMiddleware:
    def __init__(self, app, state):
        self.app = app
        self.state = state
        self.limits = state.config.limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != _PATH:
            return await self.app(scope, receive, send)
        body = await read_declared_body(scope, receive, self.limits.max_body_bytes)
        if body is None:
            return await self.app(scope, receive, send)
        if body is GONE:
            return
        plain = self._plain(scope, body) if len(body) <= HOT_MAX_BYTES else None
        if plain is None:
            return await self.app(scope, _replay(body, receive), send)
        single, texts, served = plain

        async def app(scope, receive, send):
            result, error = await settled(_PATH, self.classify(served, texts))
            if error is not None:
                return await error(scope, receive, send)
            payload = predict_payload(single, result)
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})

        await run_watched(scope, body, receive, send, app)  # cancelled if the client goes away

    def classify(self, served, texts: list[str]):
        """The scores of a plain classify request (awaitable). TEI's /predict truncates by default (its
        --auto-truncate defaults to true from v1.9.0), as the route does."""
        return run_task(self.state, served, TaskRequest(texts=texts, truncate=True), "classify")

    def _plain(self, scope, body: bytes):
        """(single?, texts, served model) for a plain classify request, else None (the route's)."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if type(data) is not dict:
            return None
        scope.setdefault("state", {})[PARSED_BODY] = data  # the route does not decode it twice
        return self.plain_request(data)

    def plain_request(self, data: dict):
        """_plain for a body already decoded to a dict (server/http/direct.py decides with it too)."""
        if not data.keys() <= _KEYS:
            return None
        raw, model = data.get("inputs"), data.get("model")
        if model is not None and type(model) is not str:
            return None
        single = type(raw) is str
        texts = [raw] if single else raw
        # TEI reads a list of exactly two strings as one pair: the route's.
        if type(texts) is not list or not texts or len(texts) == 2 and not single \
                or len(texts) > self.limits.max_inputs_per_request:
            return None
        for t in texts:
            if type(t) is not str or len(t) > self.limits.max_input_chars or not t.strip():
                return None
        try:
            served = self.state.registry.get(model)
        except SurgeError:
            return None  # the route renders the unknown-model error
        if getattr(served, "task", None) != "classify":
            return None  # the route answers (or refuses) other tasks
        return single, texts, served


def predict_payload(single: bool, result) -> bytes:
    """The route's answer to a plain classify request: one input's labels, or a list of them."""
    out = label_scores(result)
    return orjson.dumps(out[0] if single else out)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
