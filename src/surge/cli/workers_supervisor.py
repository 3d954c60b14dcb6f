"""The supervisor of `surge serve --workers N` (cli/workers.py has the children's side).

It owns everything the children share: the listening sockets, a socket directory (the engine
processes' Unix sockets, prometheus_client's multiprocess files) and a directory in /dev/shm (the
front ends' cache table, runtime/shm_cache.py, and the Responses store). None of it may outlive it:

- the HTTP port is bound (and the gRPC port held) before any engine process starts, so a port in use
  is a one-line error at once, not a traceback after minutes of loading the model;
- whatever ends it (SIGTERM, a failed start, an exception) stops every child it started and removes
  both directories (`_Children`, a `finally`): an engine process left behind keeps the model in
  device memory with nobody to stop it, and a /dev/shm table is RAM (64 MiB by default);
- a supervisor killed outright (SIGKILL, the OOM killer) cannot clean up: its children get SIGTERM
  from the kernel (PR_SET_PDEATHSIG), so no orphaned front end keeps answering on the port, and the
  next supervisor removes directories whose supervisor is gone (`_sweep`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from surge.cli.workers import CONFIG_ENV, FROM_ENV
from surge.config import ServerConfig
log = logging.getLogger("surge")

_DIR = re.compile(r"^surge-(?:workers|cache)-(\d+)-[a-z0-9_]+$")  # ours: the supervisor's pid in the name
_PR_SET_PDEATHSIG = 1


class _Stop(Exception):
    pass


def _die_with(parent: int):
    """A child's preexec: SIGTERM from the kernel when the supervisor dies (whatever kills it)."""
    def preexec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: no such guarantee
            return
        if os.getppid() != parent:  # it died before the prctl took effect
            os._exit(1)
    return preexec


def _child(role: str, config_json: str, sock: str, *extra: str, pass_fds=()) -> subprocess.Popen:
    # The settings go in the environment, not argv: they hold the API key (and a Redis URL's password),
    # and any user of the host reads a command line (/proc/PID/cmdline), where /proc/PID/environ is
    # the owner's only. The child takes them out at once (cli/workers.py: child_settings).
    env = {**os.environ, CONFIG_ENV: config_json}
    # preexec_fn is unsafe only in a process with threads; the supervisor runs none
    return subprocess.Popen([sys.executable, "-m", "surge.cli.workers", role, FROM_ENV, sock, *extra],
                            pass_fds=pass_fds, preexec_fn=_die_with(os.getpid()), env=env)


def _wait_engine(proc: subprocess.Popen, sock: str, timeout_s: float = 900.0) -> None:
    end = time.monotonic() + timeout_s
    while not os.path.exists(sock):
        if proc.poll() is not None:
            raise SystemExit(f"surge: the engine process exited ({proc.returncode}) while starting")
        if time.monotonic() > end:
            raise SystemExit("surge: the engine process did not start in time")
        time.sleep(0.1)


def _listen(config: ServerConfig) -> socket.socket:
    """The HTTP socket every front end inherits, bound before anything loads."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((config.host, config.port))
    except OSError as exc:
        listener.close()
        why = "already in use" if exc.errno == 98 else exc.strerror or str(exc)
        raise SystemExit(f"surge: cannot listen on {config.host}:{config.port}: {why}") from None
    listener.listen(4096)
    listener.set_inheritable(True)
    return listener


def _hold_grpc_port(config: ServerConfig) -> socket.socket:
    """Bind (not listen) the gRPC port with SO_REUSEPORT for as long as the supervisor runs.

    The front ends' gRPC servers bind it with SO_REUSEPORT too and the kernel spreads
    connections over them. Holding it here makes a port another program already uses fail
    at start with a clear message, and keeps servers of other users off it."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((config.host, config.grpc_port))
    except OSError as exc:
        s.close()
        raise SystemExit(f"surge: cannot bind the gRPC port {config.host}:{config.grpc_port}: {exc}") from None
    return s


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def _sweep(parent: str) -> None:
    """Remove the directories of supervisors that are gone (killed outright: nobody removed them).
    Only ours (our user's, our naming); a live supervisor's pid keeps its own."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = _DIR.match(name)
        path = os.path.join(parent, name)
        try:
            if m is None or os.stat(path).st_uid != os.getuid() or _alive(int(m.group(1))):
                continue
        except OSError:
            continue
        log.info("removing %s, left by a supervisor that is gone", path)
        shutil.rmtree(path, ignore_errors=True)


def _stop(procs, timeout_s: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve_workers(config: ServerConfig, workers: int) -> int:
    """Run the supervisor until SIGTERM / SIGINT; returns the exit code."""
    from surge.cli.workers import child_config, engine_processes
    from surge.runtime.generate_hub import AUTHKEY_ENV

    listener = _listen(config)
    _on_stop()  # from here on a SIGTERM / SIGINT (while loading too) ends in the cleanup below
    grpc_hold = None
    dirs: list[str] = []
    engines: list[subprocess.Popen] = []
    fronts: dict[int, subprocess.Popen] = {}
    try:
        grpc_hold = _hold_grpc_port(config) if config.grpc_port else None  # every front end serves gRPC too
        shm_parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        for parent in dict.fromkeys((tempfile.gettempdir(), shm_parent)):
            _sweep(parent)
        tmp = tempfile.mkdtemp(prefix=f"surge-workers-{os.getpid()}-")
        dirs.append(tmp)
        # The front ends' shared cache table (runtime/shm_cache.py): in memory where /dev/shm is there.
        dirs.append(tempfile.mkdtemp(prefix=f"surge-cache-{os.getpid()}-", dir=shm_parent))
        os.environ["SURGE_SHM_DIR"] = dirs[-1]
        n_eng = max(1, engine_processes(config, workers))
        socks = [str(Path(tmp) / f"engine{j}.sock") for j in range(n_eng)]
        # Metrics whole across processes: every child writes prometheus_client's multiprocess
        # files here, and any front end's /metrics reads them all (runtime/metrics.WholeRegistry).
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(Path(tmp) / "metrics")
        os.mkdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        import secrets

        os.environ[AUTHKEY_ENV] = secrets.token_hex(32)  # the children's key to a decoder's engine hub
        cfg = child_config(config)
        print(f"surge: starting {n_eng} engine process(es) and {workers} front ends", file=sys.stderr, flush=True)
        for sk in socks:  # they warm up side by side
            engines.append(_child("engine", cfg, sk))
        for eng, sk in zip(engines, socks):
            _wait_engine(eng, sk)
        fd = listener.fileno()

        def front(i: int) -> subprocess.Popen:  # its own engine process first, then every other one
            return _child("front", cfg, socks[i % n_eng], str(fd), ",".join(socks), pass_fds=(fd,))

        for i in range(workers):
            fronts[i] = front(i)
        _supervise(engines, fronts, front, lambda j: _child("engine", cfg, socks[j], "restarted"))
        return 0
    except _Stop:
        return 0
    finally:
        # Drain: front ends first (they answer what they hold), then the engines.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop(list(fronts.values()))
        listener.close()
        if grpc_hold is not None:
            grpc_hold.close()
        _stop(engines)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def _on_stop() -> None:
    """SIGTERM / SIGINT raise _Stop (once: the cleanup after it is not interrupted)."""
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


class RestartBackoff:
    """How long to wait before starting a child again. A child that keeps dying at once (a bad setting, a
    model that cannot load, a full disk) is started again after 0.5 s, then twice as long each time up to
    `cap_s`, instead of in a tight loop that burns the cores the other children serve on and floods the log;
    one that ran for `healthy_s` before it exited starts again at once."""

    def __init__(self, first_s: float = 0.5, cap_s: float = 30.0, healthy_s: float = 60.0, clock=time.monotonic):
        self.first_s, self.cap_s, self.healthy_s, self.clock = first_s, cap_s, healthy_s, clock
        self._started: dict = {}  # child key -> when it was last started
        self._quick: dict = {}  # child key -> exits in a row that came before healthy_s

    def started(self, key) -> None:
        self._started[key] = self.clock()

    def delay(self, key) -> float:
        """Seconds to wait before starting `key` again, now that it exited."""
        lived = self.clock() - self._started.get(key, float("-inf"))
        if lived >= self.healthy_s:
            self._quick[key] = 0
            return 0.0
        n = self._quick.get(key, 0)
        self._quick[key] = n + 1
        return min(self.cap_s, self.first_s * 2 ** n)


def _supervise(engines: list, fronts: dict, front, engine) -> None:
    """Start again every child that exits (after RestartBackoff's wait), until SIGTERM / SIGINT (_Stop)."""
    backoff = RestartBackoff()
    for j in range(len(engines)):
        backoff.started(("engine", j))
    for i in fronts:
        backoff.started(("front", i))
    try:
        while True:
            pid, status = os.wait()
            from surge.runtime.metrics import process_gone  # imported once PROMETHEUS_MULTIPROC_DIR is set

            process_gone(pid)  # its live gauges (in flight, queue depth) leave the sums
            for j, eng in enumerate(engines):
                if eng.pid == pid:
                    eng.returncode = os.waitstatus_to_exitcode(status)
                    wait = backoff.delay(("engine", j))
                    log.error("engine process %d exited (%s); starting it again in %.1f s", j, eng.returncode, wait)
                    print(f"surge: engine process {j} exited ({eng.returncode}); restarting in {wait:.1f} s",
                          file=sys.stderr, flush=True)
                    time.sleep(wait)
                    engines[j] = engine(j)
                    backoff.started(("engine", j))
                    break
            else:
                for i, p in fronts.items():
                    if p.pid == pid:
                        p.returncode = os.waitstatus_to_exitcode(status)
                        wait = backoff.delay(("front", i))
                        print(f"surge: front end {i} exited ({p.returncode}); restarting in {wait:.1f} s",
                              file=sys.stderr, flush=True)
                        time.sleep(wait)
                        fronts[i] = front(i)
                        backoff.started(("front", i))
                        break
    except ChildProcessError:
        pass
