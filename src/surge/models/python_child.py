"""The process a `kind: python` model runs in: `python -m surge.models.python_child FD`.

FD is one end of a socket pair, spoken with multiprocessing's Connection
(pickled tuples). The parent (runtime/python_worker.py) sends
("init", spec), then ("exec", [inputs, ...]) per batch, and ("stop",); this
side answers ("ready",) / ("init_error", message), and ("done", results) /
("exec_error", message) with one result per request:
("ok", outputs) or ("error", message, status). While execute runs it may send
("call", ...) for the in-process client and reads the ("reply", ...).
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from multiprocessing.connection import Connection

import numpy as np

from surge.models import python_backend as api


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    # The user's line, not surge's: a client.infer that raises points at the model.py line that called it.
    user = [f for f in frames if not f.filename.endswith(("python_child.py", "python_backend.py"))]
    where = f" (at {user[-1].filename.rsplit('/', 1)[-1]}:{user[-1].lineno})" if user else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _element(v) -> bytes:
    if isinstance(v, bytes):
        return bytes(v)
    if isinstance(v, str):
        return v.encode("utf-8")
    raise TypeError(f"a BYTES element must be bytes or str, got {type(v).__name__}")


def _array(value) -> np.ndarray:
    a = np.asarray(value)
    if a.dtype.kind == "U":
        return np.array([s.encode("utf-8") for s in a.ravel()], dtype=object).reshape(a.shape)
    if a.dtype.kind == "S":
        return a.astype(object)
    if a.dtype == object:
        # Triton's idiom is an object array of str: encoded here, as the server sends bytes. Anything
        # else (int, dict, a user class that the server could not even unpickle) fails this response.
        out = np.empty(a.shape, dtype=object)
        out.ravel()[:] = [_element(v) for v in a.ravel()] if a.size else []
        return out
    return a


def _result(resp) -> tuple:
    if isinstance(resp, api.InferenceResponse):
        if resp.error is not None:
            err = resp.error if isinstance(resp.error, api.ModelError) else api.ModelError(str(resp.error))
            return ("error", err.message, err.status)
        resp = resp.outputs
    if isinstance(resp, api.ModelError):
        return ("error", resp.message, resp.status)
    if isinstance(resp, BaseException):
        return ("error", f"{type(resp).__name__}: {resp}", 500)
    if not isinstance(resp, dict):
        return ("error", f"execute returned a {type(resp).__name__} as a response; a response is a dict of "
                         "output name -> array, an InferenceResponse or a ModelError", 500)
    outputs = {}
    for k, v in resp.items():
        try:
            outputs[str(k)] = _array(v)
        except Exception as exc:  # noqa: BLE001
            return ("error", f"response output '{k}' is not a valid array: {_describe(exc)}", 500)
    return ("ok", outputs)


def _load(spec: dict):
    path = spec["model_file"]
    module_spec = importlib.util.spec_from_file_location(f"surge_user_model_{spec['name']}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    cls = getattr(module, spec["class_name"], None)
    if cls is None:
        raise AttributeError(f"{path} has no class {spec['class_name']}")
    model = cls()
    if not callable(getattr(model, "execute", None)):
        raise AttributeError(f"{spec['class_name']} in {path} has no execute(requests) method")
    init = getattr(model, "initialize", None)
    if init is not None:
        init(spec["args"])
    return model


def _exit_with_parent(parent: int) -> None:
    """A hung execute() must not outlive the server: exit once the parent is gone (re-parented)."""
    import os
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="surge-parent-watch", daemon=True).start()


def main(fd: int) -> None:
    import os
    import signal

    # The server ends this process (stop: finalize, then exit; or kill); a SIGTERM / SIGINT sent
    # to the whole process group (a terminal's Ctrl-C, `kill -- -PGID`, a container runtime) must
    # not end it before the server has asked for finalize().
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(os.getppid())
    conn = Connection(fd)
    api.client._conn = conn
    model = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        op = msg[0]
        if op == "init":
            try:
                model = _load(msg[1])
                conn.send(("ready",))
            except BaseException as exc:  # noqa: BLE001 - reported to the server, never fatal to it
                conn.send(("init_error", _describe(exc)))
        elif op == "exec":
            requests = [api.InferenceRequest(inputs, outs or [], params or {}) for inputs, outs, params in msg[1]]
            try:
                responses = model.execute(requests)
            except BaseException as exc:  # noqa: BLE001
                status = exc.status if isinstance(exc, api.ModelError) else 500
                conn.send(("exec_error", _describe(exc), status))
                continue
            responses = list(responses) if responses is not None else []
            if len(responses) != len(requests):
                conn.send(("exec_error", f"execute returned {len(responses)} responses for {len(requests)} "
                                         "requests (one per request, in order)", 500))
                continue
            conn.send(("done", [_result(r) for r in responses]))
        elif op == "stop":
            fin = getattr(model, "finalize", None)
            if fin is not None:
                try:
                    fin()
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
            conn.send(("stopped",))
            break


if __name__ == "__main__":
    main(int(sys.argv[1]))
