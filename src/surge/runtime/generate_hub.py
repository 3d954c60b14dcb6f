"""A decoder's engine loop shared by the front ends of `surge serve --workers N`.

One process serving HTTP spends ~0.6-1.1 ms of CPU to take in a streamed generation request and
~36-46 us a chunk (benchmarks/generate_route_cpu.py, 2-core VM): a burst of 64 arrivals is parsed one
after another before their first tokens, and every delivery of 64 streams is 64 chunks. As vLLM runs
API-server processes in front of one engine core, here the engine process of `--workers`
(cli/workers.py) runs the decoder's EngineLoop (runtime/generate_core.py) alone and every front end
connects to it; each front end keeps its own streams' text, stops, cache and metrics, exactly as
GenerateService does with an engine process of its own (runtime/generate_process.py).

Engine side, `Hub`: the loop's channel and outbox over every front end's connection (a Unix socket
per engine loop, authenticated with a key the supervisor hands its children; a repository's decoder
versions each have theirs, cli/workers_generate.py). Sequence ids are the front
ends' own: the hub gives each sequence an id of the engine's and translates both ways, so each front
end gets only its own sequences' tokens, errors and admissions, in one message an iteration, with
the engine's state (its own count of sequences taken in, for its queue limit). A front end that
leaves (closed, or its process died) has its sequences aborted: their KV blocks come back before the
next step. SIGTERM ends the loop; every front end's streams then fail as unloaded. Engine-wide
metrics (KV use, running / waiting, prefix cache, preemptions, restarts) are this process's (the
front ends would count them once each).

Front-end side, `HubClient`: what GenerateService reads of a remote engine (the same surface as
EngineProcess). When the engine process dies the supervisor starts it again; `respawn()` waits for it
and connects anew.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import select
import signal
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from surge.runtime.generate_process import LoopConnection, _dumps, _loads

log = logging.getLogger("surge.generate")

AUTHKEY_ENV = "SURGE_WORKERS_AUTHKEY"  # hex, set by the supervisor for its children (cli/workers.py)


def authkey() -> bytes:
    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        raise RuntimeError(f"{AUTHKEY_ENV} is not set: the engine hub runs under `surge serve --workers`")
    return bytes.fromhex(key)


_HEADER = struct.Struct("!i")  # multiprocessing.connection's framing, which the front ends read and write
STOP, DRAIN = b"x", b"d"  # bytes on a hub's stop pipe (Hub.drain)
MAX_BACKLOG = 64 << 20  # bytes waiting for one front end before it counts as gone


HANDSHAKE_S = 5.0


class _Handshake:
    """multiprocessing.connection's send_bytes / recv_bytes over a socket with a timeout: what its
    authentication handshake (deliver_challenge / answer_challenge) calls."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send_bytes(self, data) -> None:
        self.sock.sendall(_HEADER.pack(len(data)) + bytes(data))

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        (n,) = _HEADER.unpack(self._exact(4))
        if n < 0 or (maxlength is not None and n > maxlength):
            raise OSError(f"a handshake message of {n} bytes")
        return self._exact(n)

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the connection ended in the handshake")
            buf += chunk
        return bytes(buf)


class _Front:
    __slots__ = ("conn", "fd", "ids", "received", "seen", "rbuf", "wbuf", "dead")

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.fd = conn.fileno()
        self.ids: dict[int, int] = {}  # its sequence id -> the engine's
        self.received = 0  # its sequences taken in (its queue limit counts the rest)
        self.seen: tuple | None = None  # (running, waiting, received) of the last state it was sent
        self.rbuf = bytearray()
        self.wbuf = bytearray()  # what its socket did not take yet
        self.dead = False  # gone (or too far behind): left at the next drain


class Hub:
    """EngineLoop's channel (drain / wait) and outbox (tokens / error / state) over every front end.

    Its sockets never block the loop: what a front end's socket does not take is kept for it and
    written when it drains, and one that falls MAX_BACKLOG behind (a stopped process) counts as gone;
    its sequences are aborted and the others' streams go on."""

    def __init__(self, listener: socket.socket, key: bytes, hello: tuple, stop_fd: int, metrics=None,
                 drain_s: float = 65.0):
        """`drain_s`: a drain's longest wait for the front ends to leave."""
        self.listener = listener
        self.drain_s = drain_s
        self.key = key
        self.hello = hello  # ("ready", cfg, capabilities, pid): each front end's first message
        self.stop_fd = stop_fd
        self.metrics = metrics  # GenerateMetrics of this process (engine-wide gauges and counters)
        self.fronts: dict[int, _Front] = {}  # by fd
        self.owner: dict[int, tuple[_Front, int]] = {}  # the engine's id -> (front end, its id)
        self._ids = itertools.count(1)
        self._poll = select.poll()
        self._poll.register(listener.fileno(), select.POLLIN)
        self._poll.register(stop_fd, select.POLLIN)
        self._drain_until: float | None = None  # a drain asked: close once no front end is connected

    # -- channel ---------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until a front end (or the listener, or the stop pipe) has something, or `timeout` passes (rounded
        up to a millisecond, poll's unit); True if something came."""
        if self._drain_until is not None:  # wake for the drain's deadline even when idle
            left = max(0.0, self._drain_until - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        return bool(self._poll.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))

    def drain(self) -> list:
        """The messages that arrived. On the stop pipe a STOP byte ends the loop now (every stream still
        running fails as unloaded) and a DRAIN byte once every front end has left (they leave a build
        taken out of their CATALOG after its streams), at most `drain_s` later."""
        out: list = []
        for fd, ev in self._poll.poll(0):
            if fd == self.listener.fileno():
                self._accept()
            elif fd == self.stop_fd:
                got = os.read(self.stop_fd, 64)
                if STOP in got:
                    out.append(("close",))
                elif DRAIN in got and self._drain_until is None:
                    self._drain_until = time.monotonic() + self.drain_s
            else:
                front = self.fronts.get(fd)
                if front is None:
                    continue
                if ev & select.POLLOUT:
                    self._flush(front)
                if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._read(front, out)
        for front in [f for f in self.fronts.values() if f.dead]:
            self._leave(front, out)
        if self._drain_until is not None and (not self.fronts or time.monotonic() > self._drain_until):
            out.append(("close",))
        return out

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        # the handshake within HANDSHAKE_S (a front end's own Client() answers at once; one that stalls in
        # it must not hold the engine loop), then non-blocking
        sock.settimeout(HANDSHAKE_S)
        try:
            hs = _Handshake(sock)
            deliver_challenge(hs, self.key)
            answer_challenge(hs, self.key)
            hs.send_bytes(_dumps(self.hello))
        except Exception as exc:  # noqa: BLE001 - a failed handshake costs that connection only
            log.warning("engine hub: a connection failed its handshake: %s", exc)
            sock.close()
            return
        sock.setblocking(False)
        front = _Front(sock)
        self.fronts[front.fd] = front
        self._poll.register(front.fd, select.POLLIN)

    def _read(self, front: _Front, out: list) -> None:
        while True:
            try:
                data = os.read(front.fd, 1 << 20)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                front.dead = True
                break
            front.rbuf += data
        buf, pos = front.rbuf, 0
        while len(buf) - pos >= 4:
            (n,) = _HEADER.unpack_from(buf, pos)
            if n < 0 or len(buf) - pos - 4 < n:
                break
            self._handle(front, _loads(buf[pos + 4:pos + 4 + n]), out)
            pos += 4 + n
        del buf[:pos]

    def _handle(self, front: _Front, msg, out: list) -> None:
        kind = msg[0]
        if kind == "add":
            for seq in msg[1]:
                gid = next(self._ids)
                front.ids[seq.seq_id] = gid
                self.owner[gid] = (front, seq.seq_id)
                seq.seq_id = gid
            front.received += len(msg[1])
            out.append(msg)
        elif kind == "abort":
            gid = front.ids.pop(msg[1], None)
            if gid is not None:
                self.owner.pop(gid, None)
                out.append(("abort", gid, msg[2]))
        elif kind == "adapter":  # every front end loads the configured adapters into the same slots
            out.append(msg)
        elif kind == "close":  # the front end unloads the model: it leaves
            front.dead = True

    def _leave(self, front: _Front, out: list) -> None:
        for gid in front.ids.values():
            self.owner.pop(gid, None)
            out.append(("abort", gid, "abort"))
        front.ids.clear()
        if self.fronts.pop(front.fd, None) is not None:
            self._poll.unregister(front.fd)
        front.conn.close()

    # -- outbox ----------------------------------------------------------------------------------------
    def _send(self, front: _Front, msg) -> None:
        if front.dead:
            return
        payload = _dumps(msg)
        data = _HEADER.pack(len(payload)) + payload
        if front.wbuf:
            front.wbuf += data
        else:
            try:
                n = os.write(front.fd, data)
            except BlockingIOError:
                n = 0
            except OSError:  # gone: its sequences are aborted at the next drain
                front.dead = True
                return
            if n < len(data):
                front.wbuf += data[n:]
                self._poll.modify(front.fd, select.POLLIN | select.POLLOUT)
        if len(front.wbuf) > MAX_BACKLOG:
            log.error("engine hub: a front end is %d bytes behind; dropping it", len(front.wbuf))
            front.dead = True

    def _flush(self, front: _Front) -> None:
        try:
            n = os.write(front.fd, front.wbuf)
        except BlockingIOError:
            return
        except OSError:
            front.dead = True
            return
        del front.wbuf[:n]
        if not front.wbuf:
            self._poll.modify(front.fd, select.POLLIN)

    def _state(self, state, front: _Front):
        front.seen = (state.running, state.waiting, front.received)
        return dataclasses.replace(state, received=front.received)

    def _states(self, state, skip=()) -> None:
        """The state to every front end but `skip`: to one with nothing running here only when what it
        reads of it (the counts its queue limit and stats use) changed; every front end's event loop
        would otherwise wake for each iteration of the others' streams."""
        for front in list(self.fronts.values()):
            if front in skip:
                continue
            if front.ids or front.seen != (state.running, state.waiting, front.received):
                self._send(front, ("state", self._state(state, front)))

    def tokens(self, batch, admitted, state) -> None:
        if self.metrics is not None:
            self.metrics.engine_state(state)
        owner = self.owner
        adm: dict[_Front, dict] = {}
        for gid, at in admitted.items():
            o = owner.get(gid)
            if o is not None:
                adm.setdefault(o[0], {})[o[1]] = at  # (scheduled_at, cached prompt tokens)
        parts: dict[_Front, list] = {}
        for tokens, samples, finished in batch:
            per: dict[_Front, tuple] = {}
            for gid, token in tokens.items():
                o = owner.get(gid)
                if o is None:
                    continue
                front, sid = o
                e = per.get(front)
                if e is None:
                    e = per[front] = ({}, {} if samples else None, {} if finished else None)
                e[0][sid] = token
                if samples and gid in samples:
                    e[1][sid] = samples[gid]
                if finished and gid in finished:
                    e[2][sid] = finished[gid]
            for front, (t, s, f) in per.items():
                parts.setdefault(front, []).append((t, s or None, f or None))
            if finished:
                for gid in finished:
                    o = owner.pop(gid, None)
                    if o is not None:
                        o[0].ids.pop(o[1], None)
        told = set()
        for front in list(self.fronts.values()):
            mine, a = parts.get(front), adm.get(front)
            if mine or a:
                self._send(front, ("tokens", mine or [], a or {}, self._state(state, front)))
                told.add(front)
        self._states(state, told)

    def error(self, seq_id: int, kind: str, message: str) -> None:
        o = self.owner.pop(seq_id, None)
        if o is not None:
            o[0].ids.pop(o[1], None)
            self._send(o[0], ("error", o[1], kind, message))

    def state(self, state) -> None:
        if self.metrics is not None:
            self.metrics.engine_state(state)
        self._states(state)

    def close(self) -> None:
        for front in self.fronts.values():
            if front.wbuf:  # the last messages (every stream's "unloaded"), if it takes them soon
                try:
                    with socket.socket(fileno=os.dup(front.fd)) as sock:
                        sock.settimeout(2.0)
                        sock.sendall(front.wbuf)
                except OSError:
                    pass
            front.conn.close()
        self.fronts.clear()
        self.listener.close()


@dataclasses.dataclass
class HubLoop:
    """A decoder's engine loop behind its hub, built and listening: `core.run(hub, hub)` serves it;
    a byte on `stop_w` ends it."""

    core: object  # generate_core.EngineLoop
    hub: Hub
    stop_w: int
    path: str
    generation: object  # the resolved GenerationConfig


def listen(path: str) -> socket.socket:
    """A non-blocking listening Unix socket at `path`, which appears (renamed into place) complete."""
    part = path + ".part"
    for p in (part, path):
        if os.path.exists(p):
            os.unlink(p)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(part)
    listener.listen(64)
    listener.setblocking(False)
    os.replace(part, path)
    return listener


def start_hub(spec, name: str, version: str, engine_cfg, generation, path: str, restarted: bool = False,
              drain_s: float = 65.0) -> HubLoop:
    """Build and warm a decoder's engine (`spec`: its ModelSpec; `engine_cfg`, `generation`: the
    settings) and listen on `path`, which appears (renamed into place) once the engine is warm."""
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_core import EngineLoop
    from surge.runtime.generate_metrics import GenerateMetrics
    from surge.runtime.generate_load import decoder_engine_kwargs
    from surge.runtime.loader import generate_settings

    device, precision, gen = generate_settings(spec, engine_cfg, generation)
    engine = DecoderEngine(spec.path, threads=engine_cfg.threads, **decoder_engine_kwargs(gen, device, precision))
    engine.warmup()
    core = EngineLoop(engine, gen, name)
    metrics = GenerateMetrics(name, version)
    if restarted:
        metrics.restarts.inc()
    stop_r, stop_w = os.pipe()
    os.set_blocking(stop_w, False)
    hub = Hub(listen(path), authkey(), ("ready", engine.cfg, engine.capabilities, os.getpid()), stop_r, metrics,
              drain_s)
    log.info("engine hub for %s version %s listening on %s", name, version, path)
    from surge.runtime.gc_settle import settle

    settle()  # engine warm: full collections would walk torch and the model, stalling every stream's step
    return HubLoop(core, hub, stop_w, path, gen)


def engine_main(config, spec, sock: str, restarted: bool = False) -> None:
    """The engine process of `--workers` for one decoder: build and warm the engine, listen on `sock`
    (the supervisor and the front ends wait for the path), run the loop until SIGTERM."""
    if config.engine.threads:
        import torch

        torch.set_num_threads(config.engine.threads)
    h = start_hub(spec, spec.name, "1", config.engine, config.generation, sock, restarted)
    signal.signal(signal.SIGTERM, lambda *_: os.write(h.stop_w, STOP))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides
    try:
        h.core.run(h.hub, h.hub)
    finally:
        h.hub.close()
        if os.path.exists(sock):
            os.unlink(sock)


class HubClient(LoopConnection):
    """A front end's handle on the shared engine loop: what GenerateService reads of an engine
    (`cfg`, `capabilities`) and the connection, read on the service's event loop (`attach`)."""

    remote = True
    shared = True  # other front ends use this engine too (no LoRA adapters loaded at run time)
    engine_metrics = False  # the engine process exports the engine-wide metrics
    restart_limit = None  # the supervisor restarts the engine process; this side reconnects each time

    def __init__(self, address: str, timeout_s: float = 1800.0, cancelled=None):
        """`cancelled()`: stop waiting for the engine process (the model is being unloaded)."""
        self.address = address
        self.timeout_s = timeout_s
        self._gone = threading.Event()
        self._stopped = False
        self.conn, hello = self._connect(timeout_s, cancelled or (lambda: False))
        kind, self.cfg, self.capabilities, self.pid = hello
        if kind != "ready":
            self.conn.close()
            raise RuntimeError(f"the engine process answered {kind!r}")

    def _connect(self, timeout_s: float, cancelled):
        """(connection, hello) within `timeout_s`, the handshake included: an engine process that
        accepts but does not answer (stopped, stalled) fails this attempt instead of holding the
        caller's thread for as long as it stalls (the front end tries again later)."""
        from surge.errors import ConfigError, NotReady

        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.05))  # each step of the handshake
                sock.connect(self.address)
                hs = _Handshake(sock)
                answer_challenge(hs, authkey())  # the hub delivers its challenge first (Hub._accept)
                deliver_challenge(hs, authkey())
                hello = _loads(hs.recv_bytes())
                sock.settimeout(None)  # read on the event loop from now on, blocking as Client()'s is
                return Connection(sock.detach()), hello
            except TimeoutError:  # socket.timeout
                sock.close()
                raise ConfigError(f"the engine process at {self.address} did not answer within "
                                  f"{timeout_s:.0f} s") from None
            except (FileNotFoundError, ConnectionRefusedError, EOFError, ConnectionResetError):
                sock.close()
                # not up yet (being started again: its old socket refuses until the new one replaces it)
                if cancelled():
                    raise NotReady("the model was unloaded while its engine process restarted") from None
                if time.monotonic() > deadline:
                    raise ConfigError(f"the engine process at {self.address} did not answer within "
                                      f"{timeout_s:.0f} s") from None
                time.sleep(0.1)
            except BaseException:
                sock.close()
                raise

    def respawn(self) -> "HubClient":
        """A connection to the engine process once it serves again (the supervisor starts it again;
        blocks until then, or until this client is stopped: the model unloads)."""
        return HubClient(self.address, self.timeout_s, cancelled=lambda: self._stopped)

    def _ended(self) -> None:
        self._gone.set()

    def exit_code(self, wait: float = 0.0) -> None:
        """Waits up to `wait` s for the connection to end; the shared process's exit code is its
        supervisor's to know (None)."""
        self._gone.wait(wait)
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Leave the engine process (its loop aborts this front end's sequences)."""
        self.send(("close",))
        self.stop()

    def stop(self) -> None:
        self._stopped = True  # a respawn() waiting for the engine process gives up
        self.release()
