"""Targets: how one benchmark request is sent, and how its failure is named.

Every target has `async send(texts) -> None` that raises `RequestFailed(kind)`
on any failure, so the load generator counts errors by kind instead of hiding
them: `http_429`, `http_500`, `connect` (nothing listening), `disconnect` (the
server went away mid-request), `timeout`, `bad_response` (wrong row count or
unparsable body), `grpc_<CODE>`, `engine_<Error>` (in-process).

HTTP uses keep-alive connections pooled up to the client count, through surge's
raw client (bench/rawhttp.py; TLS for https://): the generator's own CPU is taken
from the server under test when both share a machine.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

import orjson

from surge.bench.rawhttp import RawConnection

# Failures that are the server shedding load (it answered, "too busy, retry"), not a broken request: counted
# apart in reports, because an open loop past capacity should see them (surge answers overload 429 / gRPC
# RESOURCE_EXHAUSTED; 503 is what proxies and other servers use).
OVERLOAD_KINDS = frozenset({"http_429", "http_503", "grpc_RESOURCE_EXHAUSTED", "engine_Overloaded"})


class RequestFailed(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Target(Protocol):
    name: str

    async def open(self, connections: int) -> None: ...
    async def send(self, texts: list[str]) -> None: ...
    async def close(self) -> None: ...


class _HTTPTarget:
    """Shared HTTP plumbing; subclasses build the body and check the answer.

    Requests go over surge's raw keep-alive connections (bench/rawhttp.py; TLS for https://),
    pooled up to the connection count, not aiohttp's client: the generator shares the machine
    with the server under test, and aiohttp's client cost 11x its CPU a request (251 against 22 us,
    benchmarks/loadgen_clients.py; docs/benchmarks/bench.md, session 13), CPU the server does not get."""

    path = "/"

    def __init__(self, url: str, model: str | None = None, timeout_s: float = 30.0, api_key: str | None = None):
        self.base = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}  # JSON's content type: always
        self._ssl = None
        self._raw: tuple[str, int] | None = None  # host, port
        self._idle: list = []
        self._slots: asyncio.Semaphore | None = None
        self.name = f"{type(self).__name__}({self.base})"

    async def open(self, connections: int) -> None:
        parts = urlsplit(self.base)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"an HTTP target needs an http:// or https:// URL, not {self.base!r}")
        tls = parts.scheme == "https"
        if tls:
            import ssl

            # The system's CAs (SSL_CERT_FILE / SSL_CERT_DIR honoured), host names checked.
            self._ssl = ssl.create_default_context()
        self._raw = (parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80))
        # Requests beyond the pool wait for a connection: that wait is part of their latency
        # (open loop, no coordinated omission).
        self._slots = asyncio.Semaphore(max(1, connections))

    def url(self) -> str:
        return self.base + self.path

    def body(self, texts: list[str]) -> bytes:
        raise NotImplementedError

    def rows(self, answer: Any) -> int:
        raise NotImplementedError

    async def fetch(self, url: str, body: bytes | None = None) -> tuple[int, bytes]:
        """(status, body) of one request (POST with a body, else GET) on a pooled keep-alive connection;
        a failure raises RequestFailed named `connect`, `timeout` or `disconnect`."""
        host, port = self._raw
        parts = urlsplit(url)
        # Percent-encoded as aiohttp did (a model name with a space would break the request line); what
        # is already encoded stays as it is.
        path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~") + (f"?{parts.query}" if parts.query else "")
        async with self._slots:
            conn = self._idle.pop() if self._idle else None
            if conn is None or not conn.connected:
                conn = RawConnection(host, port, extra_headers=self.headers, ssl=self._ssl)
                try:
                    await asyncio.wait_for(conn.connect(), self.timeout_s)
                except asyncio.TimeoutError:
                    raise RequestFailed("connect", "timed out") from None
                except OSError as exc:
                    raise RequestFailed("connect", str(exc)) from None
            try:
                resp = await conn.request(path, body or b"", "GET" if body is None else "POST", timeout=self.timeout_s)
            except TimeoutError:  # the connection was closed with it
                raise RequestFailed("timeout") from None
            except OSError as exc:  # reset, refused on reconnect, or closed before the answer ended
                conn.close()
                raise RequestFailed("disconnect", type(exc).__name__) from None
            except BaseException:  # cancelled mid-request: its answer may still come, so not on this connection
                conn.close()
                raise
            if conn.connected:
                self._idle.append(conn)
            return resp.status, resp.body

    async def send(self, texts: list[str]) -> None:
        status, payload = await self.fetch(self.url(), self.body(texts))
        if status != 200:
            raise RequestFailed(f"http_{status}", payload[:200].decode("utf-8", "replace"))
        try:
            n = self.rows(orjson.loads(payload))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise RequestFailed("bad_response", f"{type(exc).__name__}: {exc}") from None
        if n != len(texts):
            raise RequestFailed("bad_response", f"{n} rows for {len(texts)} inputs")

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class NativeHTTP(_HTTPTarget):
    """surge's native API: POST /embed {"inputs": [...]} -> {"embeddings": [[...], ...]}."""

    path = "/embed"

    def body(self, texts):
        req = {"inputs": texts}
        if self.model:
            req["model"] = self.model
        return orjson.dumps(req)

    def rows(self, answer):
        return len(answer["embeddings"])


class OpenAIHTTP(_HTTPTarget):
    """Any OpenAI-compatible server: POST /v1/embeddings {"input": [...], "model": ...}
    (`encoding_format="base64"` asks for packed float32 vectors instead of JSON lists)."""

    def __init__(self, url: str, model: str | None = None, timeout_s: float = 30.0, api_key: str | None = None,
                 encoding_format: str | None = None):
        super().__init__(url, model, timeout_s, api_key)
        self.encoding_format = encoding_format

    def _v1(self) -> str:
        return self.base if self.base.endswith("/v1") else self.base + "/v1"

    def url(self) -> str:
        return self._v1() + "/embeddings"

    async def open(self, connections: int) -> None:
        await super().open(connections)
        if not self.model:
            # OpenAI's API requires a model: take the first one the server lists.
            try:
                status, payload = await self.fetch(self._v1() + "/models")
                if status == 200:
                    data = orjson.loads(payload).get("data") or []
                    self.model = data[0]["id"] if data else None
            except Exception:
                pass  # an unreachable server shows up as request errors

    def body(self, texts):
        req = {"input": texts}
        if self.model:
            req["model"] = self.model
        if self.encoding_format:
            req["encoding_format"] = self.encoding_format
        return orjson.dumps(req)

    def rows(self, answer):
        return len(answer["data"])


class KServeHTTP(_HTTPTarget):
    """KServe v2 / Open Inference Protocol over HTTP: a BYTES tensor named "text"."""

    def url(self) -> str:
        return f"{self.base}/v2/models/{self.model}/infer"

    async def open(self, connections: int) -> None:
        await super().open(connections)
        if not self.model:
            self.model = await self._first_model()

    async def _first_model(self) -> str:
        # The repository extension lists models; a server without it needs --model.
        try:
            status, payload = await self.fetch(self.base + "/v2/repository/index", b"{}")
            if status == 200:
                for m in orjson.loads(payload):
                    if m.get("state", "READY") == "READY":
                        return m["name"]
        except Exception:
            pass
        raise ValueError("KServe target: pass the model name (--model)")

    def body(self, texts):
        return orjson.dumps({"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES",
                                         "data": texts}]})

    def rows(self, answer):
        return int(answer["outputs"][0]["shape"][0])


class KServeGRPC:
    """KServe v2 over gRPC (inference.GRPCInferenceService) through tritonclient's asyncio client."""

    def __init__(self, url: str, model: str | None = None, timeout_s: float = 30.0, api_key: str | None = None):
        self.url = url.removeprefix("grpc://")
        self.model = model
        self.timeout_s = timeout_s
        # surge --api-key: gRPC calls carry it as metadata, as HTTP's Authorization header
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self.client = None
        self.name = f"KServeGRPC({self.url})"

    async def open(self, connections: int) -> None:
        import tritonclient.grpc.aio as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(self.url)
        if not self.model:
            try:
                index = await self.client.get_model_repository_index(headers=self.headers, as_json=True)
                self.model = index["models"][0]["name"]
            except Exception as exc:
                raise ValueError(f"KServe gRPC target: pass the model name (--model) ({exc})") from None

    async def send(self, texts: list[str]) -> None:
        import numpy as np
        from tritonclient.utils import InferenceServerException

        inp = self._grpc.InferInput("text", [len(texts)], "BYTES")
        inp.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=np.object_))
        try:
            result = await self.client.infer(self.model, [inp], client_timeout=self.timeout_s, headers=self.headers)
        except InferenceServerException as exc:
            status = str(exc.status() or "UNKNOWN").removeprefix("StatusCode.")
            kind = "timeout" if status == "DEADLINE_EXCEEDED" else f"grpc_{status}"
            raise RequestFailed(kind, str(exc.message())[:200]) from None
        outputs = result.get_response().outputs
        if not outputs or (outputs[0].shape[0] if outputs[0].shape else 0) != len(texts):
            raise RequestFailed("bad_response", "wrong output rows")

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None


class InProcess:
    """An engine in this process: a ModelService (async `embed`) or a ModelWorker (sync, run in a thread)."""

    def __init__(self, service_or_worker: Any, name: str = "in-process"):
        self.impl = service_or_worker
        self.name = name

    async def open(self, connections: int) -> None:
        pass

    async def send(self, texts: list[str]) -> None:
        from surge.errors import SurgeError

        try:
            if hasattr(self.impl, "embed"):
                result = await self.impl.embed(texts=texts)
                rows = len(result.vectors)
            else:
                rows = len(await asyncio.to_thread(self._worker_embed, texts))
        except SurgeError as exc:
            raise RequestFailed(f"engine_{type(exc).__name__}", str(exc)) from None
        except Exception as exc:  # an engine bug is a failed request, named, not a crash of the run
            raise RequestFailed(f"exception_{type(exc).__name__}", str(exc)) from None
        if rows != len(texts):
            raise RequestFailed("bad_response", f"{rows} rows for {len(texts)} inputs")

    def _worker_embed(self, texts):
        worker = self.impl
        return worker.compute(worker.tokenizer.encode(texts, truncate=True))

    async def close(self) -> None:
        pass


PROTOCOLS = {"native": NativeHTTP, "openai": OpenAIHTTP, "kserve": KServeHTTP, "kserve-grpc": KServeGRPC}


def make_target(protocol: str, url: str, model: str | None = None, timeout_s: float = 30.0,
                api_key: str | None = None):
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; one of {', '.join(PROTOCOLS)} (or in-process)")
    return PROTOCOLS[protocol](url, model, timeout_s, api_key)
