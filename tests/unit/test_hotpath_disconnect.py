"""A client that disconnects cancels its request on the task routes too (server/http/hotpath.py's
watch, and the plain /predict of server/http/task_hotpath.py), as on the embedding routes: the
runtime then drops its queued inputs instead of computing them for nobody."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest

from surge.config import LimitsConfig
from surge.server.http.hotpath import HotPathMiddleware
from surge.server.http.task_hotpath import TaskHotPathMiddleware


class Work:
    """What the request runs: started, then waits until cancelled."""

    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled = False

    async def run(self):
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def _state(served=None):
    async def call(_served, invoke):
        return await invoke(None)

    async def on_current(served_, run):  # AppState.on_current: no reload happens here
        return await run(served_)

    return SimpleNamespace(config=SimpleNamespace(limits=LimitsConfig()), call=call, on_current=on_current,
                           registry=SimpleNamespace(get=lambda name=None, version=None: served))


async def _leave_during(app, path: str, body: dict, work: Work) -> list:
    """Send `body` to `app`, disconnect once `work` has started; the messages the app sent."""
    raw = orjson.dumps(body)
    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await work.started.wait()
        return {"type": "http.disconnect"}

    sent = []

    async def send(msg):
        sent.append(msg)

    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("path,body", [
    ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
    ("/v2/rerank", {"query": "q", "documents": ["a", "b"]}),
    ("/rerank", {"query": "q", "texts": ["a", "b"]}),
    ("/predict", {"inputs": [["q", "a"]], "raw_scores": True}),
    ("/", {"inputs": {"source_sentence": "q", "sentences": ["a"]}}),
    ("/models/ce", {"inputs": "a"}),
])
def test_the_task_routes_are_cancelled_when_the_client_leaves(path, body):
    async def main():
        work = Work()

        async def route(scope, receive, send):  # the FastAPI route behind the middleware
            await work.run()

        sent = await _leave_during(HotPathMiddleware(route, _state()), path, body, work)
        assert work.cancelled and sent == []

    asyncio.run(main())


def test_the_lifecycle_routes_are_not_watched():
    """POST /models/{name}/load is no inference: a client that leaves does not cancel a load."""
    async def main():
        seen = []

        async def route(scope, receive, send):
            seen.append(await receive())  # the body, straight from the server (no replay)

        await HotPathMiddleware(route, _state())(
            {"type": "http", "method": "POST", "path": "/models/ce/load", "headers": [(b"content-length", b"0")]},
            _once({"type": "http.request", "body": b"", "more_body": False}), None)
        assert seen == [{"type": "http.request", "body": b"", "more_body": False}]

    asyncio.run(main())


def _once(msg):
    async def receive():
        return msg
    return receive


def test_a_plain_predict_is_cancelled_when_the_client_leaves():
    async def main():
        work = Work()

        class Served:
            task, name, version = "classify", "intent", "1"

            async def infer(self, req, deadline=None):
                return await work.run()

        mw = TaskHotPathMiddleware(None, _state(Served()))  # a plain body: answered here, not passed on
        sent = await _leave_during(mw, "/predict", {"inputs": "turn on the lights"}, work)
        assert work.cancelled and sent == []

    asyncio.run(main())
