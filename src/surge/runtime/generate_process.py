"""A decoder's engine loop in a process of its own (GenerationConfig.engine_process).

Why: in one process the event loop (HTTP parsing, detokenization, SSE writes) and the engine thread
take turns at one GIL. The engine thread gives it up at every device sync and then waits up to the
switch interval behind the event loop's work, which is a decode step's whole budget: through a real
server, 64 streams on an H200 got 42k tok/s and a 72 ms time to first token against 64k and 19 ms
for the same service driven in-process (benchmarks/generate_http.py, session 26), and a busy thread
beside the engine took it from 67k to 10-14k (benchmarks/generate_ab.py --busy-threads). Here the
child process builds the engine and runs runtime/generate_core.EngineLoop alone; the server process
keeps everything about text and streams.

Wire: one multiprocessing connection over a Unix socket (pickled tuples). To the child: ("add", [Sequence]),
("abort", seq_id, reason), ("close",). From it: ("ready", DecoderConfig, EngineCaps) or ("failed",
message) once, then ("tokens", batch, admitted, EngineState), ("error", seq_id, kind, message),
("state", EngineState). One message per engine iteration and one per event-loop pass: pickling 64
streams' tokens is tens of microseconds against a ~3 ms launch. The server reads the child's
messages on its event loop (`attach`). A dead child is an EOF there: every stream in flight fails at
once (EngineError) and GenerateService starts a new child (answering 503 meanwhile); a dead parent is
an EOF on the child's side, which then exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import secrets
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("surge.generate")


def _dumps(msg) -> bytes:
    # plain pickle: Connection.send's ForkingPickler builds a pickler with its reducer table each call,
    # a visible share of the event loop's work a request (py-spy, session 26)
    return pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)


_loads = pickle.loads
_HEADER = struct.Struct("!i")


def _frame(data: bytes) -> bytes:
    """`data` framed as multiprocessing.connection's send_bytes frames it (what recv_bytes reads)."""
    if len(data) > 0x7FFFFFFF:
        return _HEADER.pack(-1) + struct.pack("!Q", len(data)) + data
    return _HEADER.pack(len(data)) + data


class _ConnChannel:
    def __init__(self, conn):
        self.conn = conn

    def drain(self) -> list:
        out = []
        try:
            while self.conn.poll(0):
                out.append(_loads(self.conn.recv_bytes()))
        except (EOFError, OSError):  # the server process is gone: stop
            out.append(("close",))
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a message comes or `timeout` passes; True if one came (or the server process is gone)."""
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError):
            return True


class _ConnOutbox:
    def __init__(self, conn):
        self.conn = conn

    def tokens(self, batch, admitted, state) -> None:
        self.conn.send_bytes(_dumps(("tokens", batch, admitted, state)))

    def error(self, seq_id: int, kind: str, message: str) -> None:
        self.conn.send_bytes(_dumps(("error", seq_id, kind, message)))

    def state(self, state) -> None:
        self.conn.send_bytes(_dumps(("state", state)))


def _child_main(address: str) -> int:
    """The engine process: connect back, take the load's arguments, build the engine, run the loop."""
    from multiprocessing.connection import Client

    conn = Client(address, authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV)))
    try:
        path, engine_kwargs, config, name, threads = conn.recv()
        import torch

        from surge.engines.decoder import DecoderEngine
        from surge.runtime.generate_core import EngineLoop

        if threads:
            torch.set_num_threads(threads)
        engine = DecoderEngine(path, threads=threads, **engine_kwargs)
        engine.warmup()
        core = EngineLoop(engine, config, name)
        from surge.runtime.gc_settle import settle

        settle()  # engine warm: full collections would walk torch and the model, stalling every stream's step
    except BaseException as exc:  # reported to the server, which raises it as the load's error
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", engine.cfg, engine.capabilities))
    try:
        core.run(_ConnChannel(conn), _ConnOutbox(conn))
    except (BrokenPipeError, EOFError, OSError):  # the server process is gone
        pass
    return 0


_AUTHKEY_ENV = "SURGE_ENGINE_AUTHKEY"


def child_env() -> dict:
    """This process's environment with its import path (a Ray worker's runtime_env, a test's checkout)
    as PYTHONPATH, as multiprocessing's spawn would hand it to a child."""
    paths = [p for p in sys.path if p] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def read_on_loop(conn, loop: asyncio.AbstractEventLoop, on_message, on_exit) -> None:
    """Read `conn`'s messages on `loop`, in its thread: each complete one to `on_message`, `on_exit()`
    once the connection ends (closed, or the other process died). No reader thread: a thread that woke
    for each message would take the GIL from the event loop at its every syscall."""
    fd = conn.fileno()
    buf = bytearray()

    def readable():
        try:
            data = os.read(fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            on_exit()
            return
        buf.extend(data)
        pos, end = 0, len(buf)
        # multiprocessing.connection's framing (send_bytes): a 4-byte big-endian length, then the bytes
        while end - pos >= 4:
            (n,) = _HEADER.unpack_from(buf, pos)
            if n < 0:
                raise RuntimeError("an engine process message over 2 GiB")
            if end - pos - 4 < n:
                break
            msg = _loads(buf[pos + 4:pos + 4 + n])
            pos += 4 + n
            try:
                on_message(msg)
            except Exception:  # one message's handling must not stop the others'
                log.exception("handling an engine process message failed")
        del buf[:pos]

    loop.add_reader(fd, readable)


class LoopConnection:
    """A connection to an engine loop elsewhere, read on an event loop (`attach`) and written from it
    (`send`); `release()` stops reading it and closes it, in the attached loop's thread."""

    conn = None
    _loop: asyncio.AbstractEventLoop | None = None

    _wbuf: bytearray | None = None  # attached: the bytes the socket has not taken yet, in order

    def attach(self, loop: asyncio.AbstractEventLoop, on_message, on_exit) -> None:
        """Read the other side's messages on `loop` (`read_on_loop`); from now on `send` never blocks it."""
        self._loop = loop
        # uvloop's add_reader makes the socket non-blocking, asyncio's leaves it blocking: one way on both
        os.set_blocking(self.conn.fileno(), False)

        def ended():
            self._stop_writing()
            self._loop = None
            self._ended()
            on_exit()

        read_on_loop(self.conn, loop, on_message, ended)

    def _ended(self) -> None:
        """The connection ended (read on the loop, before on_exit)."""

    def send(self, msg) -> bool:
        """False: the other side is gone. Attached, a message the socket does not take whole (larger than its
        buffer: a request's long stop strings or grammar, a long prompt; or the other side busy) waits for
        it to drain, after what was sent before it: on the non-blocking socket a plain send_bytes would stop
        mid-message, and the other side, reading a cut stream, would die with every sequence it runs. A
        thread other than the attached loop's hands its message to the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            try:
                self.conn.send_bytes(_dumps(msg))
                return True
            except (BrokenPipeError, EOFError, OSError):
                return False
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            loop.call_soon_threadsafe(self._write, _frame(_dumps(msg)))
            return True
        return self._write(_frame(_dumps(msg)))

    def _write(self, frame: bytes) -> bool:
        if self.conn is None or self.conn.closed:
            return False
        if self._wbuf:  # earlier bytes still wait: this message goes after them
            self._wbuf += frame
            return True
        try:
            n = os.write(self.conn.fileno(), frame)
        except BlockingIOError:
            n = 0
        except OSError:
            return False
        if n < len(frame):
            self._wbuf = bytearray(memoryview(frame)[n:])
            self._loop.add_writer(self.conn.fileno(), self._flush)
        return True

    def _flush(self) -> None:
        """The socket can take more: as much of what waits as it will."""
        if not self._wbuf or self.conn is None or self.conn.closed:
            self._stop_writing()
            return
        try:
            n = os.write(self.conn.fileno(), self._wbuf)
        except BlockingIOError:
            return
        except OSError:  # the other side is gone: the reader sees the end and fails the streams
            self._stop_writing()
            return
        del self._wbuf[:n]
        if not self._wbuf:
            self._stop_writing()

    def _stop_writing(self) -> None:
        if self._wbuf is not None and self._loop is not None and self.conn is not None and not self.conn.closed:
            self._loop.remove_writer(self.conn.fileno())
        self._wbuf = None

    def release(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            self._close_conn()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._detach_and_close()
        else:
            loop.call_soon_threadsafe(self._detach_and_close)

    def _detach_and_close(self) -> None:
        self._stop_writing()
        if self._loop is not None and self.conn is not None and not self.conn.closed:
            self._loop.remove_reader(self.conn.fileno())
        self._loop = None
        self._close_conn()

    def _close_conn(self) -> None:
        if self.conn is not None and not self.conn.closed:
            self.conn.close()


class EngineProcess(LoopConnection):
    """The server side's handle on the child: what GenerateService reads of an engine (`cfg`,
    `capabilities`) and the connection to it, read on the service's event loop (`attach`).

    The child is `python -m surge.runtime.generate_process ADDRESS`, which connects back to a Unix
    socket of this process (authenticated): unlike multiprocessing's spawn it never re-imports the
    caller's main module, so a script without a `__main__` guard can load a model too."""

    remote = True  # GenerateService: the engine loop runs elsewhere

    def __init__(self, path: str | Path, engine_kwargs: dict, config, name: str = "model", threads: int = 0,
                 start_timeout_s: float = 1800.0):
        from multiprocessing.connection import Listener

        self._args = (path, engine_kwargs, config, name, threads, start_timeout_s)
        authkey = secrets.token_bytes(32)
        self._dir = tempfile.mkdtemp(prefix="surge-engine-")
        address = os.path.join(self._dir, "sock")
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = {**child_env(), _AUTHKEY_ENV: authkey.hex()}
        self.process = subprocess.Popen([sys.executable, "-m", "surge.runtime.generate_process", address], env=env)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.conn = None
        try:
            self.conn = self._accept(listener, start_timeout_s)
            self.conn.send((str(path), engine_kwargs, config, name, threads))
            msg = self._first_message(start_timeout_s)
        except BaseException:
            self.stop()
            raise
        finally:
            listener.close()
        if msg[0] != "ready":
            from surge.errors import ConfigError

            self.stop()
            raise ConfigError(f"{path}: loading the decoder in its engine process failed: {msg[1]}")
        _, self.cfg, self.capabilities = msg

    def _accept(self, listener, timeout: float):
        # accept() blocks with no timeout: wait for the socket to be readable while watching the child
        sock = listener._listener._socket
        deadline = time.monotonic() + timeout
        while not select.select([sock], [], [], 0.2)[0]:
            self._check_alive(deadline, timeout)
        return listener.accept()

    def _first_message(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            self._check_alive(deadline, timeout)
        try:
            return self.conn.recv()
        except EOFError:
            return ("failed", f"the engine process exited with code {self.process.wait(5)}")

    def _check_alive(self, deadline: float, timeout: float) -> None:
        from surge.errors import ConfigError

        if self.process.poll() is not None:
            raise ConfigError(f"the engine process exited with code {self.process.returncode} while loading")
        if time.monotonic() > deadline:
            raise ConfigError(f"the engine process did not load within {timeout:.0f} s")

    def respawn(self) -> "EngineProcess":
        """A new child loaded as this one was (blocks while it loads)."""
        return EngineProcess(*self._args)

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self, wait: float = 0.0) -> int | None:
        """The child's exit status (a signal as its negative), None while it runs after `wait` s."""
        try:
            return self.process.wait(wait)
        except subprocess.TimeoutExpired:
            return None

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to finish (its streams end as unloaded), wait for it, then stop."""
        self.send(("close",))
        self.exit_code(wait=timeout)
        self.stop()

    def stop(self) -> None:
        """Kill the child if it still runs; stop reading its connection and close it (in the attached
        loop's thread)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.release()

    def _close_conn(self) -> None:
        super()._close_conn()
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
