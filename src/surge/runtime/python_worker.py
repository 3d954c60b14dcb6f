"""Running a `kind: python` model's user code in its own process, with a time limit.

One worker process per instance (surge.models.python_child), spoken to over a
socket pair. The server side of every failure:

  initialize raises / hangs      -> the load fails (EngineError), GET /models says why
  execute returns an error        -> that request alone fails (the error's status, 400 by default)
  execute raises                  -> the batch is rerun request by request, so only the
                                     request(s) that make it raise fail (500, with the exception)
  wrong number of responses       -> the batch's requests fail (500), naming the counts
  execute runs past timeout_s     -> the worker is killed and restarted; its batch gets 504
  the worker dies (os._exit, segfault) -> restarted; its batch gets 500 with the exit code

Nothing of this reaches other models: the server process never runs user code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from surge.errors import (DeadlineExceeded, EngineError, InvalidInput, NotFound, NotReady, Overloaded,
                          SurgeError)

log = logging.getLogger("surge.python")
_BY_STATUS = {400: InvalidInput, 404: NotFound, 429: Overloaded, 503: NotReady, 504: DeadlineExceeded}


def status_error(message: str, status: int) -> SurgeError:
    return _BY_STATUS.get(status, EngineError)(message)


class _Died(Exception):
    pass


class _Hung(Exception):  # not TimeoutError: that is an OSError, which means a broken pipe here
    pass


class PythonWorker:
    """One model.py process. Sync API, used from one executor thread at a time."""

    def __init__(self, name: str, model_file: Path, class_name: str, args: dict, *,
                 timeout_s: float, init_timeout_s: float, call=None):
        self.name = name
        self.spec = {"name": name, "model_file": str(model_file), "class_name": class_name, "args": args}
        self.timeout_s = timeout_s
        self.init_timeout_s = init_timeout_s
        self.call = call  # (op, model, version, payload, timeout) -> value; the in-process client
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.restarts = 0
        self.last_error = ""

    # ---- process ------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the process and run initialize; EngineError (with the user's exception) if it fails."""
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen([sys.executable, "-m", "surge.models.python_child", str(child.fileno())],
                                     pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send(("init", self.spec))
        try:
            msg = self._wait(time.monotonic() + self.init_timeout_s)
        except _Died as exc:
            raise EngineError(f"model.py of '{self.name}': the worker {exc} during initialize") from None
        except _Hung:
            self.kill()
            raise EngineError(f"model.py of '{self.name}': initialize did not finish within "
                              f"{self.init_timeout_s:g} s") from None
        if msg[0] == "init_error":
            self.stop()
            raise EngineError(f"model.py of '{self.name}': {msg[1]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None

    def stop(self, timeout_s: float = 5.0) -> None:
        """finalize(), then exit; killed if it does not within timeout_s."""
        if self.conn is not None and self.proc is not None and self.proc.poll() is None:
            try:
                self.conn.send(("stop",))
                self._wait(time.monotonic() + timeout_s)
            except (_Died, _Hung, OSError):
                pass
        self.kill()

    def _wait(self, deadline: float):
        """The next message that is not a client call (calls are served while waiting)."""
        while True:
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and self.conn.poll(left)
                msg = self.conn.recv() if ready else None
            except (EOFError, OSError, ConnectionError):
                try:
                    code = self.proc.wait(timeout=10) if self.proc is not None else None
                except subprocess.TimeoutExpired:  # the pipe broke but the process lives on
                    code = "none (it closed its pipe)"
                self.kill()
                raise _Died(f"exited with code {code}") from None
            if msg is None:
                raise _Hung
            if msg[0] != "call":
                return msg
            self._serve_call(msg, deadline)

    def _serve_call(self, msg, deadline: float) -> None:
        _, call_id, op, model, version, payload = msg
        try:
            if self.call is None:
                raise EngineError("this server offers no client to python models")
            if model == self.name:
                raise InvalidInput(f"model '{self.name}' cannot call itself")
            value = self.call(op, model, version, payload, max(0.0, deadline - time.monotonic()))
            reply = ("reply", call_id, True, value)
        except SurgeError as exc:
            reply = ("reply", call_id, False, (exc.message, exc.http_status))
        except Exception as exc:  # noqa: BLE001
            reply = ("reply", call_id, False, (f"{type(exc).__name__}: {exc}", 500))
        self.conn.send(reply)

    # ---- execute --------------------------------------------------------------------
    def execute(self, requests: list) -> list:
        """One result per request: its outputs, or a SurgeError for it alone."""
        if self.conn is None:
            self._restart("it was not running")
            if self.conn is None:  # initialize keeps failing: say why, for every request
                return [NotReady(f"model '{self.name}' is not available: {self.last_error}")] * len(requests)
        try:
            self.conn.send(("exec", [(r, None, {}) for r in requests]))
            msg = self._wait(time.monotonic() + self.timeout_s)
        except _Hung:
            self.kill()
            why = f"execute did not finish within {self.timeout_s:g} s"
            self._restart(why)
            err = DeadlineExceeded(f"model '{self.name}': {why}; its worker was killed and restarted")
            return [err] * len(requests)
        except (_Died, OSError) as exc:
            why = f"the model.py worker {exc} during execute"
            self._restart(why)
            return [EngineError(f"model '{self.name}': {why}; it was restarted")] * len(requests)
        if msg[0] == "exec_error":
            err = status_error(f"model '{self.name}': execute failed: {msg[1]}", msg[2])
            if len(requests) > 1 and "responses for" not in msg[1]:
                return [self.execute([r])[0] for r in requests]  # find the request(s) that make it raise
            return [err] * len(requests)
        out = []
        for r in msg[1]:
            out.append(r[1] if r[0] == "ok" else status_error(f"model '{self.name}': {r[1]}", r[2]))
        return out

    def _restart(self, why: str) -> None:
        self.last_error = f"{why} at {time.strftime('%H:%M:%S')}; restarted ({self.restarts + 1} restarts)"
        log.error("python model %s: %s", self.name, self.last_error)
        self.kill()
        self.restarts += 1
        try:
            self.start()
        except EngineError as exc:
            self.last_error = f"{why}; restart failed: {exc.message}"
            log.error("python model %s: %s", self.name, self.last_error)


class PythonBackend:
    """TensorBackend over a pool of PythonWorkers (one per instance)."""

    def __init__(self, name: str, model_file: Path, class_name: str, args: dict, *, instances: int,
                 timeout_s: float, init_timeout_s: float):
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.registry = None
        self._free: list[PythonWorker] = []
        self._lock = threading.Lock()
        self.workers = [PythonWorker(name, model_file, class_name, args, timeout_s=timeout_s,
                                     init_timeout_s=init_timeout_s, call=self._call) for _ in range(instances)]
        started = []
        try:
            for w in self.workers:
                w.start()
                started.append(w)
        except BaseException:
            for w in started:
                w.stop()
            raise
        self._free = list(self.workers)

    @property
    def last_error(self) -> str:
        return next((w.last_error for w in self.workers if w.last_error), "")

    def bind_loop(self, loop) -> None:
        self.loop = loop

    def attach(self, registry) -> None:
        self.registry = registry

    def run_requests(self, requests: list) -> list:
        with self._lock:
            worker = self._free.pop()
        try:
            return worker.execute(requests)
        finally:
            with self._lock:
                self._free.append(worker)

    def _call(self, op: str, model: str, version, payload, timeout: float):
        """The in-process client: runs on the server's event loop, through the model's batcher and cache."""
        if self.loop is None or self.registry is None:
            raise EngineError("the in-process client is not connected to a server")

        async def run():
            service = self.registry.get(model, version)
            if op == "embed":
                return (await service.embed(texts=payload)).vectors
            inputs, outputs = payload
            if getattr(service, "task", "embed") != "tensor":
                raise InvalidInput(f"model '{model}' serves task '{getattr(service, 'task', 'embed')}', not 'tensor'")
            return (await service.infer(inputs, outputs)).outputs

        fut = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise DeadlineExceeded(f"call to model '{model}' did not finish in time") from None

    def close(self) -> None:
        for w in self.workers:
            w.stop()
