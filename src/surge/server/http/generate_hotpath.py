"""Generation requests answered without the framework: POST /v1/completions, /v1/chat/completions,
/v1/responses and /v1/messages, streamed or not, and the KServe generate extension
(/v2/models/{m}[/versions/{v}]/generate and generate_stream).

A streamed completion of one token cost the server's event loop ~1.1 ms of CPU on the 2-core VM,
and each further chunk ~46 us (benchmarks/generate_route_cpu.py); py-spy put FastAPI's routing,
dependency solving and middleware layers, and StreamingResponse's task group and per-chunk `send`
wrappers, at a third of it. At 64 streams a delivery is 64 chunks every ~3 ms, and a burst of
arrivals is paid one request after another before their first tokens. Here OuterHotPath
(server/http/hotpath.py) hands such a request, when it needs none of the stack's layers (JSON, no
Content-Encoding, no API key, a Content-Length within the body limit), to the routes' own answer
functions (server/http/openai_chat.ANSWERS, responses_api.ANSWERS, anthropic_messages.ANSWERS,
kserve_generate.ANSWERS), and the answer goes straight to the ASGI server's `send`.

Contract (tests/integration/test_generate_hotpath.py): the same validation, errors (status, body,
Retry-After), JSON answers and event streams as the routes, byte for byte apart from the ids and
timestamps a request makes; a request without a declared length, or one that declares more than the
limit, goes to the routes; a client that leaves cancels its request (its KV blocks are freed).
"""

from __future__ import annotations

import orjson

from surge.server.errors import settled
from surge.runtime.off_loop import prepared
from surge.server.http import fail_fast
from surge.server.http.common import checked_json, validate
from surge.server.http.generate_common import EventStream, send_sse
from surge.server.http.hotpath import GONE, read_declared_body, run_watched
from surge.server.http import kserve_generate
from surge.server.http import anthropic_messages, openai_chat, responses_api

# path -> (request model, answer, route name) of the OpenAI and Anthropic routes this hot path takes
ANSWERS = {**openai_chat.ANSWERS, **responses_api.ANSWERS, **anthropic_messages.ANSWERS}


class GenerateHotPath:
    def __init__(self, stack, state):
        self.stack = stack
        self.state = state
        self.max_body = state.config.limits.max_body_bytes

    @staticmethod
    def takes(path: str) -> bool:
        return path in ANSWERS or kserve_generate.target(path) is not None

    @staticmethod
    def _answer_for(path: str):
        """(check(body) -> request, answer(state, req, receive)) of a path this hot path takes."""
        if path in ANSWERS:
            model, answer, _ = ANSWERS[path]
            return (lambda data: validate(model, data)), answer
        name, version, kind = kserve_generate.target(path)
        fn = kserve_generate.ANSWERS[kind]
        # the route's own check: KServe's bad input is a 400, not the OpenAI routes' 422
        return kserve_generate.validated, lambda state, req, receive: fn(state, req, name, version, receive)

    async def __call__(self, scope, receive, send):
        path = scope["path"]
        body = await read_declared_body(scope, receive, self.max_body)
        if body is None:  # chunked, or over the limit: the route reads and limits it
            return await self.stack(scope, receive, send)
        if body is GONE:
            return
        check, answer = self._answer_for(path)

        async def work(receive):
            fail_fast.BODY_SIZE.set(len(body))  # the answer's own preparation goes off the loop by it too
            req = await prepared(len(body), checked_json, check, body)  # a large body: on a thread
            return await answer(self.state, req, receive)

        async def app(scope, receive, send):
            result, error = await settled(path, work(receive))
            if error is not None:
                return await error(scope, receive, send)
            if isinstance(result, EventStream):
                return await send_sse(send, result)
            payload = orjson.dumps(result.body)
            await send({"type": "http.response.start", "status": 200, "headers": [
                *((k.encode(), v.encode()) for k, v in result.headers.items()),
                (b"content-length", str(len(payload)).encode()), (b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})

        await run_watched(scope, body, receive, send, app)
