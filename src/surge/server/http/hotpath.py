"""A pure-ASGI layer in front of the embedding routes: plain requests and gone clients.

1. Plain requests skip the framework. A POST /embed or /v1/embeddings whose
   body is a plain, valid request (texts only, default options) is answered
   here with the same JSON the route would produce: from the model's local
   cache when every input is there, else through the same runtime call the
   route makes (`AppState.run`: timeout, statistics) with the same error
   rendering. FastAPI's request parsing and response machinery cost ~1 ms a
   request on this project's CPUs, more than a batched input's compute with
   the bf16 CPU engine, so the common request does without them. Anything else
   (options, token ids, odd shapes, invalid input) goes to the routes
   unchanged, which own validation and its error messages.
2. A client that disconnects while its request waits is noticed (the ASGI
   server reports http.disconnect) and the handler is cancelled, so the
   runtime drops its queued inputs before spending compute on them: on the
   embedding routes, KServe infer, and the task routes (`POST /`,
   `/models/{name}`, `/predict`, `/rerank`, `/v1/rerank`, `/v2/rerank`), where one request
   can hold thousands of (query, document) pairs.

Only requests with a Content-Length within the body limit are touched; the
rest pass straight through. A body over HOT_MAX_BYTES is never a plain request.
"""

from __future__ import annotations

import asyncio
import functools
import time

import orjson

from surge.errors import SurgeError
from surge.runtime.request import timing_headers
from surge.server.errors import settled
from surge.server.http.common import PARSED_BODY
from surge.server.http.delivery import delivered
from surge.server.http.openai_inputs import check_lengths, suspects
from surge.server.state import AppState
from surge.types import EmbedOptions

_EMBED = "/embed"
_OPENAI = "/v1/embeddings"
_NATIVE_KEYS = frozenset({"inputs", "model", "version"})
_OPENAI_KEYS = frozenset({"input", "model", "encoding_format", "user"})
_GENERATE_ENDS = ("/generate", "/generate_stream")  # KServe's generate extension (a cheap test first)


_TASKS = frozenset({"/", "/predict", "/rerank", "/v1/rerank", "/v2/rerank"})  # server/http/tei.py, rerank.py


def _watched(path: str) -> bool:
    return (path in (_EMBED, _OPENAI) or path in _TASKS
            or (path.startswith("/v2/models/") and path.endswith("/infer"))
            # HF Inference's POST /models/{name}, not the lifecycle's /models/{name}/load and the like
            or (path.startswith("/models/") and "/" not in path[8:]))

# A larger body skips the plain-request paths (here, task_hotpath.py, direct.py): they decode it on the event
# loop (twice where direct.py hands it back), which for 1-2 MB of token ids held the loop ~30 ms, while the route
# decodes and checks it on a preparation thread (common.checked_body). Such a request's compute dwarfs the ~1 ms
# of framework the plain path saves.
HOT_MAX_BYTES = 256 * 1024

GONE = object()  # read_declared_body: the client left before its body arrived


async def read_declared_body(scope, receive, max_bytes: int):
    """The whole body of a request that declares a Content-Length of at most `max_bytes`; None when it
    declares none or a larger one (the route reads and limits those), GONE when the client left first."""
    length = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            length = int(value) if value.isdigit() else None
            break
    if length is None or length > max_bytes:
        return None
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return GONE
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks)



def cached_answer(service, texts: list[str], unchecked: bool):
    """A plain request's answer from the model's local cache, or None (the full path answers it).

    `unchecked`: no length check applies (native route, or --auto-truncate). Otherwise an input
    that came out at the model's length may have been cut, and only the full path's check may answer
    it: the cache declines such a result before counting it, or the full path would count the
    request a second time (requests, inputs, hits, latency)."""
    lookup = getattr(service, "cached_result", None)  # remote models (Ray ingress) have no local cache
    if lookup is None:
        return None
    if unchecked:
        return lookup(texts)
    return lookup(texts, accept=lambda result: not suspects(service, result))


class HotPathMiddleware:
    def __init__(self, app, state: AppState):
        self.app = app
        self.state = state
        self.limits = state.config.limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not _watched(scope["path"]):
            return await self.app(scope, receive, send)
        body = await read_declared_body(scope, receive, self.limits.max_body_bytes)
        if body is None:
            return await self.app(scope, receive, send)
        if body is GONE:
            return
        app = self.app
        if scope["path"] in (_EMBED, _OPENAI) and len(body) <= HOT_MAX_BYTES:
            plain = self._plain(scope, body)
            if plain is not None:
                native, texts, service, model = plain
                start = time.perf_counter_ns()
                result = cached_answer(service, texts, native or self.limits.auto_truncate)
                if result is not None:
                    self.state.record_answered(service, result, time.perf_counter_ns() - start)  # KServe statistics
                    return await _send_json(send, *self._payload(native, model, result))
                app = self._direct(native, texts, service, model)
        await run_watched(scope, body, receive, send, app)

    # ---- 1. plain requests ----------------------------------------------------------
    def _direct(self, native: bool, texts: list[str], service, model: str):
        """An ASGI app answering one plain request that missed the cache, as the route would."""
        async def app(scope, receive, send):
            result, error = await settled(scope["path"], self.embed(native, texts, service))
            if error is not None:
                return await error(scope, receive, send)
            await _send_json(send, *self._payload(native, model, result))
        return app

    async def embed(self, native: bool, texts: list[str], service):
        """The embeddings of a plain request that missed the cache, checked as the route checks them."""
        unchecked = native or self.limits.auto_truncate
        return await self.state.run(service, texts=texts, options=EmbedOptions(),
                                    check=None if unchecked else functools.partial(check_lengths, service, texts))

    @staticmethod
    def _payload(native: bool, model: str, result) -> tuple[bytes, str, list]:
        if native:
            out = {"model": result.model, "version": result.version, "dimensions": int(result.vectors.shape[1]),
                   "embeddings": result.vectors, "usage": {"prompt_tokens": result.prompt_tokens}}
        else:
            out = {"object": "list",
                   "data": [{"object": "embedding", "index": i, "embedding": row}
                            for i, row in enumerate(result.vectors)],
                   "model": model,
                   "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}
        return orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY), result.version, timing_headers(result)

    def _plain(self, scope, body: bytes):
        """(native?, texts, service, model name asked for) for a plain, valid request, else None (the route's)."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if type(data) is not dict:
            return None
        # A miss goes on to the route: hand it the parsed body so it is not decoded twice.
        scope.setdefault("state", {})[PARSED_BODY] = data
        return self.plain_request(scope["path"], data)

    def plain_request(self, path: str, data: dict):
        """_plain for a body already decoded to a dict (server/http/direct.py decides with it too)."""
        native = path == _EMBED
        if native and self.state.config.tei_embed:
            return None  # TEI's bare-array shape: the route answers
        if not data.keys() <= (_NATIVE_KEYS if native else _OPENAI_KEYS):
            return None
        raw = data.get("inputs" if native else "input")
        texts = [raw] if type(raw) is str else raw
        if type(texts) is not list or not texts or len(texts) > self.limits.max_inputs_per_request:
            return None
        for t in texts:
            if type(t) is not str or len(t) > self.limits.max_input_chars or not t.strip():
                return None
        model, version = data.get("model"), data.get("version")
        if (model is not None and type(model) is not str) or (version is not None and type(version) is not str):
            return None
        if not native:
            if data.get("encoding_format", "float") != "float" or type(data.get("user", "")) is not str:
                return None
        try:
            service = self.state.registry.get(model, version)
        except SurgeError:
            return None  # the route renders the unknown-model error
        return native, texts, service, model or service.name


async def run_watched(scope, body: bytes, receive, send, app) -> None:
    """Run `app` in this task, cancelled if the client goes away meanwhile: noticed by the
    server's `surge.disconnect` extension where it has one (server/http/frontend.py, the
    `--workers` front ends), else by a watcher task awaiting `receive()`.

    (The first version ran the handler in a task of its own and waited on it and the watcher
    with asyncio.wait: two tasks and a wait per request, ~10% of a front end's CPU under load.)"""
    gone: asyncio.Event | None = None  # made when the app waits for the disconnect
    is_gone = False
    given = False
    finished = False
    running = True
    cancelled_here = False
    task = asyncio.current_task()

    async def replay():
        nonlocal given, gone
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        if not is_gone:
            gone = gone or asyncio.Event()
            await gone.wait()
        return {"type": "http.disconnect"}

    def mark_gone() -> None:
        nonlocal is_gone, cancelled_here
        is_gone = True
        if gone is not None:
            gone.set()
        cancelled_here = True
        task.cancel()

    watch = scope.get("extensions", {}).get("surge.disconnect")  # server/http/frontend.DisconnectWatch
    if watch is not None:
        def lost() -> None:
            if running:
                mark_gone()

        if not watch.add(lost):
            return  # gone before the handler started
        try:
            await app(scope, replay, send)
        except asyncio.CancelledError:
            if not cancelled_here:
                raise
            task.uncancel()
        finally:
            running = False
            watch.discard(lost)
        return

    async def tracked_send(msg):
        nonlocal finished
        if msg["type"] == "http.response.body" and not msg.get("more_body", False):
            finished = True
        await send(msg)

    def watched(w: asyncio.Future) -> None:
        if not running or w.cancelled() or w.exception() is not None:
            return
        if w.result()["type"] == "http.disconnect" and not finished:
            mark_gone()  # the client has gone: stop the work (queued inputs are dropped)

    watcher = asyncio.ensure_future(receive())
    watcher.add_done_callback(watched)
    try:
        await app(scope, replay, tracked_send)
    except asyncio.CancelledError:
        if not cancelled_here:
            raise
        task.uncancel()
    finally:
        running = False
        if not watcher.done():
            watcher.cancel()


class OuterHotPath:
    """The hot paths in front of the whole middleware stack, for the requests they surely take.

    FastAPI wraps every request in its error, telemetry, body-limit and exception layers, then
    ours (content type, decompression); under load on the H200 that stack cost more per plain
    embedding request than tokenizing it. A POST /embed or /v1/embeddings that needs none of those
    layers (Content-Type application/json, no Content-Encoding, no API key configured) goes
    straight to the hot path here, and so does a POST /v1/completions, /v1/chat/completions, /v1/responses,
    /v1/messages or KServe generate / generate_stream (server/http/generate_hotpath.py); everything else,
    and anything the embedding hot path does not answer itself, goes through the full stack (whose own
    HotPathMiddleware then sees the same body). Every POST, whichever way it goes, has what it counts answered
    (latency, KServe statistics) counted once its response is delivered (server/http/delivery.py).
    """

    def __init__(self, stack, state: AppState):
        from surge.server.http.generate_hotpath import ANSWERS, GenerateHotPath

        self.stack = stack
        hot = HotPathMiddleware(stack, state)
        self.generate = GenerateHotPath(stack, state)
        self.paths = {_EMBED: hot, _OPENAI: hot, **{path: self.generate for path in ANSWERS}}
        self.open = not state.config.api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            hot = self.paths.get(path)
            if hot is None and path.endswith(_GENERATE_ENDS) and self.generate.takes(path):
                hot = self.generate  # KServe's generate extension
            if hot is self.generate:  # a generation, by the hot path or the routes
                app = self._generation
            elif hot is not None and self._plain(scope):
                app = hot
            else:
                app = self.stack
            return await delivered(scope, receive, send, app)  # counted answered once delivered
        return await self.stack(scope, receive, send)

    async def _generation(self, scope, receive, send):
        if self._plain(scope):
            return await self.generate(scope, receive, send)
        return await self.stack(scope, receive, send)

    def _plain(self, scope) -> bool:
        """Whether a hot path may take the request: no API key, a JSON body, no Content-Encoding."""
        if not self.open:
            return False
        ctype = coding = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                ctype = value
            elif name == b"content-encoding":
                coding = value
        return coding is None and ctype is not None and ctype.split(b";", 1)[0].strip().lower() == b"application/json"


def install_outer(app, state: AppState) -> None:
    """Put OuterHotPath around the app's middleware stack (Starlette builds it on first call)."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: OuterHotPath(build(), state)


async def _send_json(send, payload: bytes, version: str, extra: list = ()) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
        (b"x-surge-model-version", version.encode()), *extra]})
    await send({"type": "http.response.body", "body": payload})
