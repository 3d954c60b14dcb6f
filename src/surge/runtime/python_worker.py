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
  ... and that restart fails      -> the worker is *down* (Triton: a stub that cannot restart):
                                     with every worker down the model is not ready (model and
                                     server readiness, the index: UNAVAILABLE with the reason) and
                                     its requests get 503 at once; a background thread restarts it
                                     with capped exponential backoff until initialize works again

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
        self.call = call  # (op, model, version, payload, timeout, callers) -> value; the in-process client
        # The chains of python models waiting on the batch being executed (one per request): a call from
        # execute to one of them would wait for a worker that waits for this one (a cycle).
        self._callers: list[tuple[str, ...]] = []
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.restarts = 0
        self.last_error = ""
        # Down: its restart failed. Then the backend's restart thread owns proc and conn (execute does
        # not touch them), until a start succeeds and clears the flag.
        self.down = False
        self.on_down = None  # called (from the executing thread) when the worker goes down
        self._abort = threading.Event()  # close(): end a start that is under way

    # ---- process ------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the process and run initialize; EngineError (with the user's exception) if it fails."""
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen([sys.executable, "-m", "surge.models.python_child", str(child.fileno())],
                                     pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        if self._abort.is_set():  # abort() ran before proc was set: it could not kill this one
            parent.close()
            self.kill()
            raise EngineError(f"model.py of '{self.name}': the model is being unloaded")
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

    def abort(self) -> None:
        """End a start() under way in another thread (its initialize may hang for init_timeout_s): the
        process is killed, so start() sees it die. The flag covers a start that has not spawned yet."""
        self._abort.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()

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
            chain = self._cycle(model)
            if chain:
                raise InvalidInput(f"model '{self.name}' calls model '{model}', which waits for this call: a call "
                                   f"cycle ({' -> '.join(chain)}) that would deadlock; refused")
            # Every chain of the batch goes with the call: execute's calls belong to no one request of it.
            callers = tuple(dict.fromkeys(m for c in self._callers for m in c)) + (self.name,)
            value = self.call(op, model, version, payload, max(0.0, deadline - time.monotonic()), callers)
            reply = ("reply", call_id, True, value)
        except SurgeError as exc:
            reply = ("reply", call_id, False, (exc.message, exc.http_status))
        except Exception as exc:  # noqa: BLE001
            reply = ("reply", call_id, False, (f"{type(exc).__name__}: {exc}", 500))
        self.conn.send(reply)

    # ---- execute --------------------------------------------------------------------
    def _cycle(self, model: str) -> list[str]:
        """The call path that `model` would close into a cycle ([] if none): a caller chain holding it."""
        for chain in self._callers:
            if model in chain:
                return [*chain[chain.index(model):], self.name, model]
        return []

    def execute(self, requests: list, parameters: list[dict] | None = None,
                callers: list[tuple[str, ...]] | None = None, outputs: list | None = None) -> list:
        """One result per request: its outputs, or a SurgeError for it alone. `parameters`: each request's
        KServe parameters (request.parameters() in model.py); `callers`: the python models waiting on each;
        `outputs`: the output names each asked for (request.requested_output_names() in model.py)."""
        parameters = parameters or [{}] * len(requests)
        outputs = outputs or [()] * len(requests)
        self._callers = [c for c in (callers or []) if c]
        if self.down:  # the restart thread is on it: answer at once, never wait for an initialize
            return [self.unavailable()] * len(requests)
        try:
            self.conn.send(("exec", [(r, list(o), p) for r, o, p in zip(requests, outputs, parameters)]))
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
                # find the request(s) that make it raise
                chains = callers or [()] * len(requests)
                return [self.execute([r], [p], [c], [o])[0]
                        for r, p, c, o in zip(requests, parameters, chains, outputs)]
            return [err] * len(requests)
        out = []
        for r in msg[1]:
            out.append(r[1] if r[0] == "ok" else status_error(f"model '{self.name}': {r[1]}", r[2]))
        return out

    def unavailable(self) -> NotReady:
        return NotReady(f"model '{self.name}' is not ready: {self.last_error}")

    def _restart(self, why: str) -> None:
        """One restart, in the thread that saw the worker die (the common case, a crash that a fresh process
        gets over, then costs no readiness flap); if it fails the worker goes down."""
        self.last_error = f"{why} at {time.strftime('%H:%M:%S')}; restarted ({self.restarts + 1} restarts)"
        log.error("python model %s: %s", self.name, self.last_error)
        self.kill()
        self.restarts += 1
        try:
            self.start()
        except EngineError as exc:
            self.last_error = f"{why}; restart failed: {exc.message}; restarting in the background"
            log.error("python model %s: %s", self.name, self.last_error)
            self.down = True
            if self.on_down is not None:
                self.on_down(self)

    def try_start(self) -> bool:
        """A background restart of a down worker (the restart thread only); True once it is up."""
        self.kill()
        self.restarts += 1
        try:
            self.start()
        except EngineError as exc:
            self.last_error = f"restart {self.restarts} failed: {exc.message}; restarting in the background"
            return False
        self.last_error = f"up again at {time.strftime('%H:%M:%S')} after {self.restarts} restarts"
        self.down = False
        return True


class PythonBackend:
    """TensorBackend over a pool of PythonWorkers (one per instance)."""

    # Backoff between background restarts of a down worker: a model whose initialize keeps failing
    # costs a process start every RESTART_MAX_S at most, and one that recovers is back within it.
    RESTART_FIRST_S = 0.5
    RESTART_MAX_S = 30.0

    def __init__(self, name: str, model_file: Path, class_name: str, args: dict, *, instances: int,
                 timeout_s: float, init_timeout_s: float):
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.registry = None
        self._free: list[PythonWorker] = []
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._restarter: threading.Thread | None = None
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
        for w in self.workers:
            w.on_down = self._went_down
        self._free = list(self.workers)

    @property
    def last_error(self) -> str:
        return next((w.last_error for w in self.workers if w.last_error), "")

    @property
    def available(self) -> bool:
        """False while every worker is down: the service is then not ready (runtime/tensor_service.py)."""
        return not all(w.down for w in self.workers)

    @property
    def unavailable_reason(self) -> str:
        """Why the model is down ("" while a worker is up): the repository index shows it as UNAVAILABLE."""
        return "" if self.available else self.workers[0].last_error

    def bind_loop(self, loop) -> None:
        self.loop = loop

    def attach(self, registry) -> None:
        self.registry = registry

    def run_requests(self, requests: list, parameters: list[dict] | None = None,
                     callers: list[tuple[str, ...]] | None = None, outputs: list | None = None) -> list:
        with self._cond:
            while True:
                up = [w for w in self._free if not w.down]
                if up:
                    worker = up[-1]
                    self._free.remove(worker)
                    break
                if not self.available:  # nothing will serve it: 503 now, not after a restart
                    return [self.workers[0].unavailable()] * len(requests)
                self._cond.wait()  # the workers that are up are all busy: wait for one, as a full pool does
        try:
            return worker.execute(requests, parameters, callers, outputs)
        finally:
            with self._cond:
                self._free.append(worker)
                self._cond.notify_all()

    # ---- down workers -------------------------------------------------------------
    def _went_down(self, worker: PythonWorker) -> None:
        with self._cond:
            if self._closing.is_set():
                return
            if self._restarter is None or not self._restarter.is_alive():
                self._restarter = threading.Thread(target=self._restart_loop, name=f"surge-{self.name}-restart",
                                                   daemon=True)
                self._restarter.start()
        self._readiness_changed()

    def _restart_loop(self) -> None:
        """Restart the down workers until all are up (or the model is closed): the first try at once, then
        after a delay that doubles up to RESTART_MAX_S. A start that hangs is bounded by init_timeout_s."""
        delay = self.RESTART_FIRST_S
        while not self._closing.is_set():
            with self._cond:
                down = [w for w in self.workers if w.down]
                if not down:
                    self._restarter = None
                    return
            was_available = self.available
            for w in down:
                if self._closing.is_set():
                    return
                if w.try_start():
                    log.warning("python model %s: a worker is up again (%d restarts)", self.name, w.restarts)
                    delay = self.RESTART_FIRST_S
                    with self._cond:
                        self._cond.notify_all()
                else:
                    log.error("python model %s: %s", self.name, w.last_error)
            if self.available != was_available:
                self._readiness_changed()
            if any(w.down for w in self.workers):
                self._closing.wait(delay)  # woken at once by close()
                delay = min(delay * 2, self.RESTART_MAX_S)

    def _readiness_changed(self) -> None:
        """Readiness changed outside any request: tell the registry's listeners (gRPC health Watch)."""
        loop, registry = self.loop, self.registry
        if loop is not None and registry is not None and not loop.is_closed():
            loop.call_soon_threadsafe(registry.readiness_changed)

    def _call(self, op: str, model: str, version, payload, timeout: float, callers: tuple[str, ...] = ()):
        """The in-process client: runs on the server's event loop, through the model's batcher and cache."""
        if self.loop is None or self.registry is None:
            raise EngineError("the in-process client is not connected to a server")

        async def run():
            service = self.registry.get(model, version)
            if op == "embed":
                return (await service.embed(texts=payload)).vectors
            inputs, outputs, parameters = payload
            if getattr(service, "task", "embed") != "tensor":
                raise InvalidInput(f"model '{model}' serves task '{getattr(service, 'task', 'embed')}', not 'tensor'")
            return (await service.infer(inputs, outputs, parameters=parameters, callers=callers)).outputs

        fut = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise DeadlineExceeded(f"call to model '{model}' did not finish in time") from None

    def close(self) -> None:
        self._closing.set()
        with self._cond:
            restarter = self._restarter
        if restarter is not None:
            for w in self.workers:
                if w.down:
                    w.abort()  # a background start may be waiting on a hung initialize
            restarter.join()
        for w in self.workers:
            w.stop()
