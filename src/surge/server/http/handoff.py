"""Lone connections served by the engine process itself (`--workers`, `--engine-connections`).

Under `--workers` a request crosses from its front end to the engine process and back: two
socket hops, two process wake-ups and the framing on both sides. For one client on the H200 host
that is ~250 us of a ~1.2 ms request (docs/benchmarks/serving_core.md, session 5's timeline),
while one process (`--workers 1`) answers in ~1.0 ms. So a front end that accepts a connection
while its engine process serves fewer than `--engine-connections` of its own hands the
connection over, before reading a byte: the socket goes to the engine process (SCM_RIGHTS over
a datagram socket, `Intake`), whose own HTTP stack (the same app, its local batcher) serves it
from then on. Under load every other connection stays with the front ends: the engine process
takes at most that many connections, counted in a small file both sides lock (`Slots`).

The guarantees stay those of the front ends:
- The front end keeps a duplicate of every socket it handed over. If its engine process dies
  (the IPC connection ends), it answers each of them `503` with `Retry-After` and closes it:
  a request in flight there fails at once, as it would on a front end's own connection.
- The engine process shuts a handed connection down when its HTTP layer closes it (the front
  end's duplicate would otherwise keep it open); the front end closes its duplicate once the
  socket reports hang-up (polled every second, without reading it).
- A hand-over that fails (the engine process is restarting) leaves the connection with the
  front end, which serves it as any other.
- Load comes back to the front ends: when a response on a handed connection completes while
  front ends' requests are in the engine process's batcher, and nothing of a next request has
  been read, the engine process stops reading it and hands it back (a RETURN frame on the IPC
  socket, runtime/ipc_wire.py); the front end serves it from its duplicate. Served by the engine
  process, a closed-loop client runs ~4x faster than the others at 64 clients, and its HTTP,
  JSON and tokenizing took the engine process's loop from batching (H200, call 1 of session 6:
  11,596 against 14,318 req/s at 64 clients without the hand-back).
- SIGTERM: front ends drain first, then the engine process drains its own connections
  (uvicorn's graceful shutdown) before its engines close.
HTTP only: gRPC connections belong to grpcio's server and stay with the front ends.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import logging
import os
import select
import socket
import struct

log = logging.getLogger("surge")

_COUNT = struct.Struct("<i")
_OFFER = struct.Struct("<iQ")  # the front end's pid, its id of the connection
_UNAVAILABLE = (b'HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n'
                b'connection: close\r\ncontent-length: %d\r\n\r\n%s')
_BODY = (b'{"error":{"message":"the engine process went away; retry","type":"server_error",'
         b'"param":null,"code":"not_ready"}}')
UNAVAILABLE = _UNAVAILABLE % (len(_BODY), _BODY)


def intake_path(engine_sock: str) -> str:
    """Where engine process `engine_sock` takes handed-over connections."""
    return engine_sock + ".conn"


def slots_path(engine_sock: str) -> str:
    return engine_sock + ".http"


class Slots:
    """How many connections an engine process serves itself: a counter in a file, under flock.

    Taken by a front end before it hands a connection over, given back by the engine process
    when that connection closes; a new engine process starts it at 0 (its predecessor's
    connections died with it)."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def _update(self, fn) -> bool:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            raw = os.pread(self._fd, 4, 0)
            n = _COUNT.unpack(raw)[0] if len(raw) == 4 else 0
            new = fn(n)
            if new is None:
                return False
            os.pwrite(self._fd, _COUNT.pack(new), 0)
            return True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reset(self) -> None:
        self._update(lambda n: 0)

    def take(self, limit: int) -> bool:
        """One more connection for the engine process, if it serves fewer than `limit`."""
        return self._update(lambda n: n + 1 if n < limit else None)

    def give(self) -> None:
        self._update(lambda n: max(0, n - 1))

    def count(self) -> int:
        raw = os.pread(self._fd, 4, 0)
        return _COUNT.unpack(raw)[0] if len(raw) == 4 else 0

    def close(self) -> None:
        os.close(self._fd)


class Handoff:
    """A front end's side: offers each new connection to its engine process."""

    def __init__(self, engine_sock: str, limit: int, reap_s: float = 1.0):
        self.limit = limit
        self.reap_s = reap_s
        self._intake = intake_path(engine_sock)
        self._slots_path = slots_path(engine_sock)
        self._slots: Slots | None = None
        self._ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._ctl.setblocking(False)
        self.held: dict[int, socket.socket] = {}  # duplicates of the sockets handed over, by id
        self._ids = 0
        self._reaper: asyncio.TimerHandle | None = None
        self._make_protocol = None  # () -> this front end's HTTP protocol, for connections handed back
        self.enabled = False  # on once this front end serves (engine_back), off while the engine is away
        self.handed = 0  # connections handed over (tests, logs)
        self.returned = 0  # and handed back

    def offer(self, transport, make_protocol=None) -> bool:
        """Hand `transport`'s connection (nothing read from it yet) to the engine process.
        True: it is the engine process's now and the transport is closed; False: keep it.
        `make_protocol()`: the protocol that serves the connection here if it is handed back."""
        if not self.enabled or self.limit <= 0:
            return False
        if make_protocol is not None:
            self._make_protocol = make_protocol
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        try:
            if self._slots is None:
                self._slots = Slots(self._slots_path)
            if not self._slots.take(self.limit):
                return False
        except OSError:
            return False
        fd = sock.fileno()
        try:
            keep = socket.socket(fileno=os.dup(fd))
        except OSError:
            self._slots.give()
            return False
        self._ids += 1
        try:
            # sendmsg, not socket.send_fds: that one drops its address argument (CPython 3.11)
            self._ctl.sendmsg([_OFFER.pack(os.getpid(), self._ids)],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, self._intake)
        except OSError:  # no engine process listening (restarting): this front end serves it
            keep.close()
            self._slots.give()
            return False
        self.held[self._ids] = keep
        self.handed += 1
        transport.abort()  # this process's descriptor only: the connection lives on in the engine's
        self._schedule_reap()
        return True

    def engine_lost(self) -> None:
        """The engine process went away: its connections answer 503 and close (requests in flight
        there fail at once, as on a front end's own connection); no hand-over until it is back."""
        self.enabled = False
        held, self.held = self.held, {}
        for s in held.values():
            try:
                s.setblocking(False)
                s.send(UNAVAILABLE)
            except OSError:
                pass
            _shut(s)
        if held:
            log.warning("engine process lost: %d handed-over connection(s) answered 503", len(held))

    def engine_back(self) -> None:
        self.enabled = True

    def take_back(self, conn_id: int) -> None:
        """The engine process handed connection `conn_id` back (it read nothing after its last
        response): serve it here from the duplicate."""
        sock = self.held.pop(conn_id, None)
        if sock is None:
            return
        if self._make_protocol is None:
            _shut(sock)
            return
        self.returned += 1
        sock.setblocking(False)
        asyncio.get_running_loop().create_task(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self._make_protocol, sock)
        except Exception:  # noqa: BLE001 - a connection that cannot be served is closed, nothing else
            log.exception("connection handed back")
            _shut(sock)

    def _schedule_reap(self) -> None:
        if self._reaper is None and self.held:
            self._reaper = asyncio.get_running_loop().call_later(self.reap_s, self._reap)

    def _reap(self) -> None:
        """Close the duplicates of connections the engine process has shut down (hang-up)."""
        self._reaper = None
        if not self.held:
            return
        poller = select.poll()
        by_fd = {}
        for cid, s in self.held.items():
            try:
                by_fd[s.fileno()] = cid
                poller.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            except (OSError, ValueError):
                pass
        for fd, _ in poller.poll(0):
            cid = by_fd.get(fd)
            if cid is not None:
                self.held.pop(cid).close()
        self._schedule_reap()

    def close(self) -> None:
        self.enabled = False
        if self._reaper is not None:
            self._reaper.cancel()
        self._ctl.close()
        if self._slots is not None:
            self._slots.close()


class Handed:
    """One connection the engine process serves for front end `pid` (its id `conn_id` there)."""

    __slots__ = ("intake", "keep", "pid", "conn_id", "back")

    def __init__(self, intake: "Intake", keep: socket.socket, pid: int, conn_id: int):
        self.intake, self.keep, self.pid, self.conn_id = intake, keep, pid, conn_id
        self.back = False

    def busy(self) -> bool:
        """Front ends' requests are in this process's batcher: serving HTTP here would slow them."""
        return self.intake.busy()

    def hand_back(self) -> bool:
        """Give the connection back to its front end (the caller read nothing after its last
        response and closes its transport next, without a shutdown); False: keep serving it."""
        if self.back or not self.intake.give_back(self.pid, self.conn_id):
            return False
        self.back = True
        self.intake.returned += 1
        return True

    def closed(self) -> None:
        """From the protocol's connection_lost: shut the connection down (the front end's duplicate
        would keep it open) unless it went back to the front end."""
        self.intake.open -= 1
        if self.back:
            self.keep.close()
        else:
            _shut(self.keep)
        self.intake.slots.give()


class Intake:
    """The engine process's side: serves connections its front ends hand over.

    `protocol(handed)` makes the HTTP protocol for one connection (uvicorn's, on this process's
    app), which calls `handed.closed()` from its `connection_lost`. `give_back(pid, conn_id)` tells
    a front end to take a connection back (False: that front end is gone); `busy()` says when to."""

    def __init__(self, engine_sock: str, protocol, give_back=None, busy=None):
        self._path = intake_path(engine_sock)
        self.slots = Slots(slots_path(engine_sock))
        self.slots.reset()
        self._protocol = protocol
        self.give_back = give_back or (lambda pid, conn_id: False)
        self.busy = busy or (lambda: False)
        self.returned = 0
        self._sock: socket.socket | None = None
        self.served = 0  # connections taken (tests, logs)
        self.open = 0

    def start(self) -> None:
        if os.path.exists(self._path):
            os.unlink(self._path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(self._path)
        s.setblocking(False)
        self._sock = s
        asyncio.get_running_loop().add_reader(s.fileno(), self._ready)

    def _ready(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self._sock, _OFFER.size, 8)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.error("connection intake: %s", exc)
                return
            pid, conn_id = _OFFER.unpack(msg) if len(msg) == _OFFER.size else (0, 0)
            for fd in fds:
                loop.create_task(self._serve(socket.socket(fileno=fd), pid, conn_id))

    async def _serve(self, conn: socket.socket, pid: int, conn_id: int) -> None:
        conn.setblocking(False)
        # A duplicate to shut the connection down at the end (the front end holds one too).
        handed = Handed(self, conn.dup(), pid, conn_id)
        self.served += 1
        self.open += 1
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: self._protocol(handed), conn)
        except Exception:  # noqa: BLE001 - a connection that cannot be served is closed, nothing else
            log.exception("handed-over connection")
            conn.close()
            handed.closed()

    def stop(self) -> None:
        """No more hand-overs (front ends then keep their connections); served ones go on."""
        if self._sock is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            except RuntimeError:
                pass
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self._path)
            except OSError:
                pass


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
